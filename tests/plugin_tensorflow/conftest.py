"""Start 2-worker TensorFlow jobs on 127.0.0.1 (TF_CONFIG), with a timeout, and collect results.

Each worker writes a JSON file; a worker still running at the deadline is killed
by its pid. Nothing listens on anything but loopback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "worker.py"

def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def worker_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("TF_USE_LEGACY_KERAS", None)
    env.update(extra or {})
    return env


def launch(argv_for_rank, tmp_path: Path, *, world: int = 2, timeout: float = 120.0,
           env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``argv_for_rank(rank)`` as ``world`` TF_CONFIG workers; returns their completed processes.

    Raises ``TimeoutError`` (after killing them) if they are not all done within ``timeout``.
    """
    ports = free_ports(world)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    logs = []
    try:
        for rank in range(world):
            penv = worker_env(env)
            penv["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})
            log = open(tmp_path / f"worker{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(argv_for_rank(rank), env=penv, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=str(tmp_path), start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            left = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.1, left))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"TensorFlow workers still running after {timeout:.0f} s; logs:\n"
                                   + _logs(logs)) from None
        done = []
        for rank, proc in enumerate(procs):
            logs[rank].seek(0)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, logs[rank].read(), ""))
        return done
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: only its processes
                proc.wait(timeout=10)
        for log in logs:
            log.close()


def _logs(logs) -> str:
    out = []
    for rank, log in enumerate(logs):
        log.flush()
        log.seek(0)
        out.append(f"--- worker {rank} ---\n" + log.read()[-3000:])
    return "\n".join(out)


def run_scenario(scenario: str, tmp_path: Path, *, timeout: float = 120.0, env: dict | None = None) -> list[dict]:
    """Run ``worker.py SCENARIO`` on 2 workers; returns each worker's JSON result."""
    outs = [tmp_path / f"{scenario}.{rank}.json" for rank in range(2)]
    procs = launch(lambda rank: [sys.executable, str(WORKER), scenario, str(outs[rank])], tmp_path,
                   timeout=timeout, env=env)
    results = []
    for rank, out in enumerate(outs):
        assert out.exists(), \
            f"worker {rank} wrote no result (rc={procs[rank].returncode}):\n{procs[rank].stdout[-4000:]}"
        data = json.loads(out.read_text())
        assert "crash" not in data, f"worker {rank} failed:\n{data['crash']}\n{procs[rank].stdout[-2000:]}"
        results.append(data)
    return results


@pytest.fixture(scope="session")
def tf_job():
    """:func:`run_scenario`, for tests and module-scoped fixtures."""
    return run_scenario


@pytest.fixture(scope="session")
def tf_launch():
    """:func:`launch`: start TF_CONFIG workers with any argv, for tests that read what each wrote."""
    return launch


@pytest.fixture(scope="session")
def tf_worker_env():
    """:func:`worker_env`: the environment for a TensorFlow worker process."""
    return worker_env
