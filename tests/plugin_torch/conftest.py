"""Launch multi-process gloo tests: one subprocess per rank, each under a timeout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import free_port, init_one_rank_group, run_workers, worker_env

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def one_rank_group():
    """A world of one gloo rank for a module's tests (``pytest.mark.usefixtures("one_rank_group")``)."""
    import torch.distributed as dist

    init_one_rank_group()
    yield
    dist.destroy_process_group()


def run_ranks(tmp_path: Path, world: int, *flags: str, script: Path = HERE / "dist_worker.py",
              timeout: float = 90.0, env: dict | None = None, may_die: tuple = ()) -> list:
    """Run ``script`` on ``world`` gloo ranks; return each rank's JSON result (rank order).

    Processes still running at the timeout are killed by pid and the test fails.
    """
    port = free_port()
    outs = [tmp_path / f"rank{rank}.json" for rank in range(world)]
    commands = [[sys.executable, str(script), "--out", str(out), *flags] for out in outs]
    envs = [worker_env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                            LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", **(env or {}))) for rank in range(world)]
    try:
        procs = run_workers(commands, envs, [tmp_path / f"rank{rank}.log" for rank in range(world)],
                            timeout=timeout)
    except TimeoutError as exc:
        pytest.fail(f"ranks did not finish within {timeout} s (a hang): {' '.join(flags)}\n{exc}")
    results = []
    for rank, out in enumerate(outs):
        if not out.exists() and rank in may_die:
            results.append(None)
            continue
        if not out.exists():
            pytest.fail(f"rank {rank} wrote no result (exit {procs[rank].returncode}):\n{procs[rank].stdout[-3000:]}")
        results.append(json.loads(out.read_text()))
    return results


@pytest.fixture
def ranks(tmp_path):
    """``ranks(world, *flags)`` runs dist_worker.py on ``world`` ranks."""
    def run(world: int, *flags: str, **kw):
        return run_ranks(tmp_path, world, *flags, **kw)
    return run
