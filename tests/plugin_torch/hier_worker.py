"""One rank of 2 nodes x 2 ranks: the two-level all-reduce alone (HierarchicalAllReduce), many pieces at once."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from commsched.plugins.torch.hierarchical import HierarchicalAllReduce

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--skip-on-rank", type=int, default=-1, help="this rank never starts piece 'late' (the others do)")
ap.add_argument("--timeout", type=float, default=30.0)
args = ap.parse_args()
dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
hier = HierarchicalAllReduce(2, world // 2, timeout_s=args.timeout)
result: dict = {"rank": rank}
lock, finished = threading.Lock(), threading.Event()
sizes = [1, 2, 3, 63, 64, 1000, 4097, 65536, 5, 300_001] * 4
done_order: list[str] = []
errors: dict[str, str] = {}
t0 = time.monotonic()
elapsed: dict[str, float] = {}


def done_for(name: str, total: int):
    def done(exc):
        with lock:
            done_order.append(name)
            elapsed[name] = time.monotonic() - t0
            if exc is not None:
                errors[name] = f"{type(exc).__name__}: {exc}"
            if len(done_order) == total:
                finished.set()
    return done


if args.skip_on_rank < 0:
    # integer-valued floats: every summation order gives the same sum, so the check is exact
    tensors = [torch.arange(n, dtype=torch.float32) % 97 + rank * 1000 for n in sizes]
    expected = [torch.arange(n, dtype=torch.float32) % 97 * world + 1000 * sum(range(world)) for n in sizes]
    for i, t in enumerate(tensors):
        hier.start(t, done_for(f"p{i}", len(sizes)), f"p{i}", step=i // 20)  # two labelled steps
    result["finished"] = finished.wait(120)
    result["in_order"] = done_order == [f"p{i}" for i in range(len(sizes))]
    result["exact"] = all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))
    result["phases"] = hier.phase_stats()
    result["times"] = hier.phase_times()
else:
    if rank != args.skip_on_rank:
        hier.start(torch.ones(1000), done_for("late", 1), "late")
        result["finished"] = finished.wait(args.timeout * 4 + 10)
t_close = time.monotonic()
hier.close()
result.update(errors=errors, elapsed=elapsed, close_s=time.monotonic() - t_close, max_in_flight=hier.max_in_flight,
              threads_after_close=[t.name for t in threading.enumerate() if t.name.startswith("commsched-hier-")])
Path(args.out).write_text(json.dumps(result))
dist.destroy_process_group()
