"""Interpreter exit without ``kv.close()`` does not hang on the MXNet backend: exit status 0, within
the configured ``timeout_s`` of the script's main code returning."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import assert_clean_exit, run_workers, worker_env

pytest.importorskip("mxnet")

SCRIPT = Path(__file__).resolve().parent / "forgot_close.py"
TIMEOUT_S = 15.0  # the script's SchedulerConfig(timeout_s=...): the bound on every wait, so on exit too
START_S = 90.0  # importing mxnet and three pushpulls, on a loaded machine


@pytest.mark.timeout(START_S + TIMEOUT_S + 30)
def test_a_forgotten_kvstore_does_not_hang_exit(tmp_path):
    finished = run_workers([[sys.executable, str(SCRIPT), str(tmp_path), str(TIMEOUT_S)]],
                           [worker_env({"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})],
                           [tmp_path / "rank0.log"], timeout=START_S, markers=[[tmp_path / "rank0.done"]],
                           exit_within=TIMEOUT_S)
    assert_clean_exit(finished, TIMEOUT_S)
