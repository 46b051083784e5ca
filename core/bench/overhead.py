"""The scheduler's own CPU cost per piece, on the in-process backend with an instant link.

Run::

    python -m commsched.bench.overhead --json overhead.json [--pieces N] [--ranks R] [--profile]

For 1 rank and for ``R`` thread-ranks (``dynamic`` ordering: rank 0 decides and
publishes through the in-memory store, the others follow) it submits ``N``
pieces per rank (tensors of ``--pieces-per-tensor`` pieces, mixed priorities),
then measures, over the whole run and all threads of the process:

* ``process_time()`` per piece per rank (CPU seconds, all threads), and wall time
  per piece;
* the same for the bare engine: every rank calls ``backend.start`` on the same
  pieces directly, without the scheduler;
* the scheduler's overhead = scheduled - bare (CPU and wall).

Ranks are threads of one process, so the CPU cost per piece per rank is the
process's CPU time divided by ``pieces x ranks``; with several ranks it also
includes the cost of the order agreement (publishing and reading decisions).
The target is under 50 us of CPU per piece. This is a micro-benchmark, not a
timed test: compare results as ratios on one machine. ``--profile`` adds a
cProfile of every thread of one scheduled run (the top functions by own time).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import cProfile
import io
import json
import platform
import pstats
import statistics
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

from commsched.backends import ArrayOps, InProcessWorld
from commsched.config import SchedulerConfig
from commsched.partition import piece_bounds
from commsched.scheduler import Scheduler

__all__ = ["measure", "main"]

TARGET_US = 50.0
ELEMENT_BYTES = 4  # float32


def _tensors(rank: int, pieces: int, pieces_per_tensor: int, elements_per_piece: int) -> list[array.array]:
    n_tensors = max(1, pieces // pieces_per_tensor)
    return [array.array("f", [float(rank + 1)] * (pieces_per_tensor * elements_per_piece)) for _ in range(n_tensors)]


def _timed(world_size: int, body: Callable[[int], None]) -> tuple[float, float]:
    """Run ``body(rank)`` on one thread per rank, all released together; (cpu_s, wall_s) of the process."""
    go = threading.Barrier(world_size + 1)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        go.wait()
        try:
            body(rank)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"overhead-rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if errors:
        raise errors[0]
    return cpu, wall


def _run_scheduled(world_size: int, pieces: int, pieces_per_tensor: int, elements_per_piece: int,
                   credit_pieces: int | None) -> tuple[float, float, int]:
    partition = elements_per_piece * ELEMENT_BYTES
    credit = partition * credit_pieces if credit_pieces else 1 << 30
    config = SchedulerConfig(partition_bytes=partition, credit_bytes=credit, ordering="dynamic", timeout_s=120)
    world = InProcessWorld(world_size)
    schedulers = [Scheduler(world.backend(r), ArrayOps(), config, store=world.store, key_prefix="overhead")
                  for r in range(world_size)]
    tensors = [_tensors(r, pieces, pieces_per_tensor, elements_per_piece) for r in range(world_size)]

    def body(rank: int) -> None:
        s = schedulers[rank]
        for i, t in enumerate(tensors[rank]):
            s.submit(f"t{i}", t, priority=-i)  # the last submitted is the most urgent, as in backward
        s.mark_step()
        s.synchronize()

    try:
        cpu, wall = _timed(world_size, body)
        started = schedulers[0].stats()["pieces"]
    finally:
        for s in schedulers:
            s.close()
        world.close()
    return cpu, wall, started


def _run_bare(world_size: int, pieces: int, pieces_per_tensor: int,
              elements_per_piece: int) -> tuple[float, float, int]:
    """The engine alone: the same pieces, started in the same order by every rank, no scheduler."""
    world = InProcessWorld(world_size)
    ops = ArrayOps()
    per_rank = []
    for r in range(world_size):
        plan = []
        for i, t in enumerate(_tensors(r, pieces, pieces_per_tensor, elements_per_piece)):
            for index, (lo, hi) in enumerate(piece_bounds(len(t), ELEMENT_BYTES, elements_per_piece * ELEMENT_BYTES)):
                plan.append(SimpleNamespace(name=f"t{i}#{index}", nbytes=(hi - lo) * ELEMENT_BYTES,
                                            view=ops.flat_view(t, lo, hi)))
        per_rank.append(plan)
    finished = [threading.Event() for _ in range(world_size)]

    def body(rank: int) -> None:
        plan = per_rank[rank]
        left = [len(plan)]
        lock = threading.Lock()

        def done(exc: BaseException | None) -> None:
            if exc is not None:
                raise exc
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    finished[rank].set()

        backend = world.backend(rank)
        for p in plan:
            backend.start(p, done)
        if not finished[rank].wait(120):
            raise TimeoutError("the bare engine did not finish")

    try:
        cpu, wall = _timed(world_size, body)
    finally:
        world.close()
    return cpu, wall, len(per_rank[0])


def measure(world_size: int, pieces: int, *, pieces_per_tensor: int = 16, elements_per_piece: int = 1,
            credit_pieces: int | None = None, repeat: int = 3) -> dict[str, Any]:
    """Scheduled and bare cost per piece for one configuration (best of ``repeat`` runs each)."""
    sched_runs, bare_runs = [], []
    n = 0
    for _ in range(repeat):
        cpu, wall, n = _run_scheduled(world_size, pieces, pieces_per_tensor, elements_per_piece, credit_pieces)
        sched_runs.append((cpu, wall))
        cpu, wall, n_bare = _run_bare(world_size, pieces, pieces_per_tensor, elements_per_piece)
        bare_runs.append((cpu, wall))
        assert n_bare == n, (n_bare, n)
    per = 1e6 / (n * world_size)  # us per piece per rank
    sched_cpu = min(c for c, _ in sched_runs) * per
    bare_cpu = min(c for c, _ in bare_runs) * per
    sched_wall = min(w for _, w in sched_runs) * 1e6 / n
    bare_wall = min(w for _, w in bare_runs) * 1e6 / n
    return {
        "ranks": world_size,
        "pieces_per_rank": n,
        "pieces_per_tensor": pieces_per_tensor,
        "piece_bytes": elements_per_piece * ELEMENT_BYTES,
        "credit_pieces": credit_pieces,
        "mode": "local" if world_size == 1 else "leader/follower",
        "repeat": repeat,
        "scheduled": {"cpu_us_per_piece": sched_cpu, "wall_us_per_piece": sched_wall,
                      "cpu_us_runs": [c * per for c, _ in sched_runs]},
        "bare": {"cpu_us_per_piece": bare_cpu, "wall_us_per_piece": bare_wall,
                 "cpu_us_runs": [c * per for c, _ in bare_runs]},
        "overhead": {"cpu_us_per_piece": sched_cpu - bare_cpu, "wall_us_per_piece": sched_wall - bare_wall,
                     "cpu_us_per_piece_median": statistics.median(c for c, _ in sched_runs) * per
                     - statistics.median(c for c, _ in bare_runs) * per},
        "target_us_per_piece": TARGET_US,
        "within_target": sched_cpu - bare_cpu < TARGET_US,
    }


@contextlib.contextmanager
def _profile_all_threads(profiles: list[cProfile.Profile]) -> Iterator[None]:
    """Profile every thread started inside the block (cProfile is per thread).

    Wraps ``threading.Thread.run`` for the duration of the block only; this is a
    measurement tool run as its own process, never imported by the library.
    """
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        profile = cProfile.Profile(time.thread_time)  # CPU time: waiting on locks does not count
        profile.enable()
        try:
            original(self)
        finally:
            profile.disable()
            profiles.append(profile)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.run = original  # type: ignore[method-assign]


def profile_run(world_size: int, pieces: int, top: int = 20) -> str:
    """cProfile (thread CPU time) of one scheduled run, all threads merged, top functions by own time."""
    profiles: list[cProfile.Profile] = []
    with _profile_all_threads(profiles):
        _run_scheduled(world_size, pieces, 16, 1, None)
    out = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=out)
    for p in profiles[1:]:
        stats.add(p)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commsched.bench.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--pieces", type=int, default=20000, help="pieces per rank per run (default 20000)")
    parser.add_argument("--ranks", type=int, default=2, help="thread-ranks of the multi-rank run (default 2)")
    parser.add_argument("--pieces-per-tensor", type=int, default=16)
    parser.add_argument("--credit-pieces", type=int, default=0,
                        help="credit in pieces (default 0: unlimited, so only the scheduler's cost is measured)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration; the best is reported")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of a scheduled run")
    args = parser.parse_args(argv)
    if args.pieces < 1 or args.ranks < 1 or args.pieces_per_tensor < 1 or args.repeat < 1:
        parser.error("--pieces, --ranks, --pieces-per-tensor and --repeat must be at least 1")

    configs = sorted({1, args.ranks})
    results = [measure(r, args.pieces, pieces_per_tensor=args.pieces_per_tensor,
                       credit_pieces=args.credit_pieces or None, repeat=args.repeat) for r in configs]
    report = {
        "benchmark": "commsched.bench.overhead",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "target_us_per_piece": TARGET_US,
        "results": results,
    }
    print(f"{'ranks':>5} {'pieces':>7} {'sched cpu':>10} {'bare cpu':>9} {'overhead':>9} "
          f"{'sched wall':>11} {'bare wall':>10}   (us per piece; cpu per rank)")
    for r in results:
        print(f"{r['ranks']:>5} {r['pieces_per_rank']:>7} {r['scheduled']['cpu_us_per_piece']:>10.1f} "
              f"{r['bare']['cpu_us_per_piece']:>9.1f} {r['overhead']['cpu_us_per_piece']:>9.1f} "
              f"{r['scheduled']['wall_us_per_piece']:>11.1f} {r['bare']['wall_us_per_piece']:>10.1f}"
              f"   {'ok' if r['within_target'] else 'ABOVE TARGET'} (< {TARGET_US:g} us)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    if args.profile:
        print(profile_run(args.ranks, min(args.pieces, 20000)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
