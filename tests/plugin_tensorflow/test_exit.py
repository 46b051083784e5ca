"""Interpreter exit without ``close()`` does not hang, on every TensorFlow backend: exit status 0,
within the configured ``timeout_s`` of the main code returning."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import assert_clean_exit, free_ports, horovod_or_skip, horovodrun, run_workers, worker_env

pytest.importorskip("tensorflow")

SCRIPT = Path(__file__).resolve().parent / "forgot_close.py"
TIMEOUT_S = 20.0  # the script's SchedulerConfig(timeout_s=...): the bound on every collective, so on exit too
START_S = 200.0  # importing TensorFlow and tracing, on a loaded machine
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1"}


@pytest.mark.timeout(START_S + TIMEOUT_S + 30)
def test_collective_workers_exit_without_close(tmp_path):
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    envs = [worker_env(dict(TF_ENV, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": r}})))
            for r in range(2)]
    finished = run_workers([[sys.executable, str(SCRIPT), "collective", str(tmp_path), str(TIMEOUT_S)]] * 2, envs,
                           [tmp_path / f"rank{r}.log" for r in range(2)], timeout=START_S, cwd=tmp_path,
                           markers=[[tmp_path / f"rank{r}.done"] for r in range(2)], exit_within=TIMEOUT_S)
    assert_clean_exit(finished, TIMEOUT_S)


@pytest.mark.timeout(START_S + TIMEOUT_S + 150)
def test_horovod_ranks_exit_without_close(tmp_path):
    horovod_or_skip("tensorflow")
    finished = run_workers([horovodrun(2, str(SCRIPT), "horovod", str(tmp_path), str(TIMEOUT_S))],
                           [worker_env(TF_ENV)], [tmp_path / "horovodrun.log"], timeout=START_S, cwd=tmp_path,
                           markers=[[tmp_path / "rank0.done", tmp_path / "rank1.done"]], exit_within=TIMEOUT_S)
    assert_clean_exit(finished, TIMEOUT_S)
