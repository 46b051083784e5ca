#!/usr/bin/env python3
"""Soak: many steps on a small model, 2 ranks, watching memory, threads and store keys.

Each rank trains ``--steps`` steps of a small MLP with commsched (small pieces, small
credit, so every step starts many pieces) and samples, every ``--every`` steps, its
resident set size (``/proc/self/statm``), its thread count (``/proc/self/status``) and,
on rank 0 of torch/gloo, the number of keys in the rendezvous store. The baseline is the
sample after warm-up (``--warmup`` steps: allocators, the static plan, lazy imports).

Pass criteria (the issue's): RSS at the end at most 5 % above the baseline, the thread
count the same at every sample after warm-up, and the store's key count the same at
every sample after warm-up (bounded: the queues are popped, nothing accumulates).

Usage::

    python scripts/soak.py --backends torch,horovod --steps 2000 --out soak.json
    python scripts/soak.py --backends torch --steps 200                 # what CI runs

Backends: ``torch`` (gloo) and ``horovod`` (torch on Horovod over gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("torch", "horovod")
RSS_GROWTH_LIMIT = 0.05


def sample(store=None) -> dict:
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * page
    threads = None
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss_bytes": rss, "threads": threads, "store_keys": store.num_keys() if store is not None else None}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn as nn

    import commsched
    from commsched.plugins.torch import DistributedOptimizer

    torch.set_num_threads(1)
    store = None
    if args.worker == "horovod":
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if rank == 0:
            store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    config = commsched.SchedulerConfig(partition_bytes=2048, credit_bytes=8192, ordering=args.ordering, timeout_s=60)
    samples = []
    with DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model, backend=args.worker,
                              config=config) as opt:
        g = torch.Generator().manual_seed(rank)
        for step in range(args.steps):
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            if step % args.every == 0 or step == args.steps - 1:
                samples.append(dict(step=step, **sample(store)))
        opt.synchronize()
        stats = opt.stats()
    Path(args.out).write_text(json.dumps({"rank": rank, "samples": samples, "pieces": stats["pieces"],
                                          "after_close": sample(store)}))
    if args.worker == "torch":
        dist.destroy_process_group()


def judge(rank_result: dict, warmup: int) -> dict:
    """The figures and the verdict of one rank."""
    after = [s for s in rank_result["samples"] if s["step"] >= warmup]
    base, last = after[0], after[-1]
    growth = (last["rss_bytes"] - base["rss_bytes"]) / base["rss_bytes"]
    threads = sorted({s["threads"] for s in after})
    keys = sorted({s["store_keys"] for s in after if s["store_keys"] is not None})
    why = []
    if growth >= RSS_GROWTH_LIMIT:
        why.append(f"RSS grew {growth:.1%} (limit {RSS_GROWTH_LIMIT:.0%})")
    if len(threads) != 1:
        why.append(f"thread count changed: {threads}")
    if len(keys) > 1:
        why.append(f"store keys changed: {keys}")
    return {"rank": rank_result["rank"], "rss_base_mib": round(base["rss_bytes"] / 2**20, 2),
            "rss_end_mib": round(last["rss_bytes"] / 2**20, 2), "rss_growth": round(growth, 4),
            "rss_max_mib": round(max(s["rss_bytes"] for s in after) / 2**20, 2), "threads": threads,
            "store_keys": keys, "pieces": rank_result["pieces"], "ok": not why, "why": why}


def run_backend(backend: str, steps: int, every: int, warmup: int, ordering: str, workdir: Path,
                timeout: float) -> dict:
    import socket

    me = [sys.executable, str(Path(__file__).resolve()), "--worker", backend, "--steps", str(steps),
          "--every", str(every), "--ordering", ordering]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cleanup = []
    if backend == "torch":
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        extra = [dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2") for r in range(2)]
    else:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer

        server = RendezvousServer()
        port = server.start()
        server.init(get_host_assignments(parse_hosts("localhost:2"), 2))
        cleanup.append(server.stop)
        extra = [dict(HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                      HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="lo",
                      HOROVOD_HOSTNAME="localhost", HOROVOD_RANK=str(r), HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK=str(r),
                      HOROVOD_LOCAL_SIZE="2", HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1") for r in range(2)]
    outs = [workdir / f"{backend}.rank{r}.json" for r in range(2)]
    logs = [open(workdir / f"{backend}.rank{r}.log", "wb") for r in range(2)]
    started = time.monotonic()
    procs = [subprocess.Popen([*me, "--out", str(outs[r])], env={**env, **extra[r]}, stdout=logs[r],
                              stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True) for r in range(2)]
    try:
        for p in procs:
            p.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # the worker's own session: only what it started
                p.wait(timeout=10)
        for log in logs:
            log.close()
        for fn in cleanup:
            fn()
    seconds = time.monotonic() - started
    if not all(o.exists() for o in outs):
        return {"ok": False, "why": [f"a rank wrote no result (exit {[p.returncode for p in procs]}); logs in "
                                     f"{workdir}"], "seconds": round(seconds, 1)}
    ranks = [judge(json.loads(o.read_text()), warmup) for o in outs]
    return {"ok": all(r["ok"] for r in ranks) and all(p.returncode == 0 for p in procs), "steps": steps,
            "ordering": ordering, "warmup": warmup, "seconds": round(seconds, 1), "ranks": ranks,
            "returncodes": [p.returncode for p in procs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="torch,horovod", help=f"comma-separated, from {', '.join(BACKENDS)}")
    ap.add_argument("--steps", type=int, default=2000, help="steps per run (default 2000)")
    ap.add_argument("--every", type=int, default=50, help="sample every this many steps (default 50)")
    ap.add_argument("--warmup", type=int, default=None, help="baseline step (default: a tenth of --steps)")
    ap.add_argument("--ordering", default="dynamic", choices=["dynamic", "static", "fifo"])
    ap.add_argument("--out", default="soak.json")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)  # --out is this rank's result file
        return 0
    if args.steps < 2 or args.every < 1:
        ap.error("--steps must be at least 2 and --every at least 1")
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        ap.error(f"--backends: unknown {', '.join(bad)}; use some of {', '.join(BACKENDS)}")
    warmup = args.warmup if args.warmup is not None else max(args.every, args.steps // 10)
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="commsched-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = {b: run_backend(b, args.steps, args.every, warmup, args.ordering, workdir,
                             timeout=120 + args.steps * 0.5) for b in backends}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
