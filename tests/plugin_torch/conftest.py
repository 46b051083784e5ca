"""Launch multi-process gloo tests: one subprocess per rank, each under a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path: Path, world: int, *flags: str, script: Path = HERE / "dist_worker.py",
              timeout: float = 90.0, env: dict | None = None, may_die: tuple = ()) -> list:
    """Run ``script`` on ``world`` gloo ranks; return each rank's JSON result (rank order).

    Processes still running at the timeout are killed by pid and the test fails.
    """
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.json"
        outs.append(out)
        penv = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                    WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(script), "--out", str(out), *flags], env=penv,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            logs.append(stdout)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        pytest.fail(f"ranks did not finish within {timeout} s (a hang): {' '.join(flags)}")
    results = []
    for rank, out in enumerate(outs):
        if not out.exists() and rank in may_die:
            results.append(None)
            continue
        if not out.exists():
            pytest.fail(f"rank {rank} wrote no result (exit {procs[rank].returncode}):\n{logs[rank][-3000:]}")
        results.append(json.loads(out.read_text()))
    return results


@pytest.fixture
def ranks(tmp_path):
    """``ranks(world, *flags)`` runs dist_worker.py on ``world`` ranks."""
    def run(world: int, *flags: str, **kw):
        return run_ranks(tmp_path, world, *flags, **kw)
    return run
