"""Interpreter exit without ``opt.close()`` does not hang, on every torch backend.

commsched's threads (the scheduler's and Horovod's waiter) are non-daemon; a
forgotten ``close()`` must still let the process exit, within the configured
``timeout_s`` of its main code returning, with exit status 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import assert_clean_exit, free_port, horovod_or_skip, horovodrun, run_workers, worker_env

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "forgot_close.py"
TIMEOUT_S = 15.0  # the scripts' SchedulerConfig(timeout_s=...): the bound on every wait, so on exit too
START_S = 150.0  # importing torch and training three steps, on a loaded machine


@pytest.mark.timeout(START_S + TIMEOUT_S + 30)
def test_gloo_ranks_exit_without_close(tmp_path):
    port = free_port()
    envs = [worker_env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                            OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")) for r in range(2)]
    finished = run_workers([[sys.executable, str(SCRIPT), "torch", str(tmp_path), str(TIMEOUT_S)]] * 2, envs,
                           [tmp_path / f"rank{r}.log" for r in range(2)], timeout=START_S,
                           markers=[[tmp_path / f"rank{r}.done"] for r in range(2)], exit_within=TIMEOUT_S)
    assert_clean_exit(finished, TIMEOUT_S)


@pytest.mark.timeout(START_S + TIMEOUT_S + 150)
def test_horovod_ranks_exit_without_close(tmp_path):
    horovod_or_skip("torch")
    finished = run_workers([horovodrun(2, str(SCRIPT), "horovod", str(tmp_path), str(TIMEOUT_S))],
                           [worker_env({"OMP_NUM_THREADS": "1"})], [tmp_path / "horovodrun.log"], timeout=START_S,
                           markers=[[tmp_path / "rank0.done", tmp_path / "rank1.done"]], exit_within=TIMEOUT_S)
    assert_clean_exit(finished, TIMEOUT_S)
