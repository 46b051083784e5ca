"""Run MXNet parameter-server jobs (scheduler + servers + workers on loopback) with
``commsched launch mxnet``, each under a timeout, and find any process a job left behind.

Every job's processes carry ``COMMSCHED_TEST_JOB=<uuid>`` in their environment, so
stray ones are found by that tag (read from /proc) and ended by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from commsched.bench.procs import pids_with_env
from helpers import worker_env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
REPO = HERE.parents[1]


def tagged_pids(tag: str) -> list[int]:
    """Pids of live processes whose environment holds ``COMMSCHED_TEST_JOB=tag``."""
    return pids_with_env("COMMSCHED_TEST_JOB", tag)


@dataclass
class Job:
    """What a finished job left: exit status, output, per-rank JSON results, stray pids."""

    returncode: int
    output: str
    results: dict[int, object] = field(default_factory=dict)
    stray: list[int] = field(default_factory=list)
    seconds: float = 0.0


def run_job(out: Path, *worker_args: str, command: list[str] | None = None, workers: int = 2, servers: int = 1,
            timeout: float = 120.0, grace: float = 5.0, env: dict | None = None,
            job_timeout: float | None = None) -> Job:
    """Run ``worker.py --out out worker_args`` (or ``command``) on a launched job; never hang.

    The launcher gets ``job_timeout`` (default ``timeout - 15``) seconds for the whole
    job; past ``timeout`` the test kills it (SIGTERM first, so it can stop its
    children) and fails.
    """
    out.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    worker_cmd = command or [sys.executable, str(WORKER), "--out", str(out), *worker_args]
    cmd = [sys.executable, "-m", "commsched", "launch", "mxnet", "--workers", str(workers), "--servers",
           str(servers), "--timeout", str(job_timeout or timeout - 15), "--grace", str(grace), "--", *worker_cmd]
    penv = worker_env({"COMMSCHED_TEST_JOB": tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=penv, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        _kill(tagged_pids(tag))
        pytest.fail(f"the job did not finish within {timeout} s (a hang):\n{output[-4000:]}")
    seconds = time.monotonic() - start
    stray = tagged_pids(tag)
    _kill(stray)
    results = {}
    for path in sorted(out.glob("rank*.json")):
        results[int(path.stem[4:])] = json.loads(path.read_text())
    return Job(proc.returncode, output, results, stray, seconds)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def find_tagged():
    """:func:`tagged_pids`: live processes of a job, by its tag."""
    return tagged_pids


@pytest.fixture(scope="session")
def launch():
    """:func:`run_job` itself, for module-scoped fixtures."""
    return run_job


@pytest.fixture(scope="session")
def run_scenarios():
    """``run_scenarios(folder, scenarios, timeout)``: one launched job runs every scenario (name ->
    worker options); returns ``{name: {rank: result}}`` after checking the job ended cleanly
    (exit 0, no stray process, no thread left, no scenario error on any worker)."""
    def run(folder: Path, scenarios: dict, timeout: float = 150) -> dict:
        flags = []
        for name, sc in scenarios.items():
            flags += ["--scenario", json.dumps({**sc, "name": name})]
        job = run_job(folder, *flags, timeout=timeout)
        assert job.returncode == 0, job.output[-4000:]
        assert job.stray == [], f"processes left running: {job.stray}"
        assert sorted(job.results) == [0, 1], job.output[-4000:]
        by_name: dict = {}
        for rank, payload in job.results.items():
            assert payload["threads_left"] == [], payload["threads_left"]
            for r in payload["results"]:
                assert "error" not in r, f"rank {rank} {r['scenario']['name']}: {r['error']}"
                by_name.setdefault(r["scenario"]["name"], {})[rank] = r
        return by_name
    return run


@pytest.fixture
def job(tmp_path):
    """``job(*worker_args, **kw)`` runs worker.py on a launched 2-worker, 1-server job."""
    counter = iter(range(100))

    def run(*worker_args: str, **kw) -> Job:
        return run_job(tmp_path / f"job{next(counter)}", *worker_args, **kw)
    return run
