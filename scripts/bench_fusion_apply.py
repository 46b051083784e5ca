"""Micro benchmark of fusion and lean apply: step time of a small model with many layers.

    .venv/bin/python scripts/bench_fusion_apply.py --ranks 2 --fusion 0,16KiB,64KiB,256KiB,1MiB
    .venv/bin/python scripts/bench_fusion_apply.py --ranks 1 --fusion 0 --lean both

A stack of ``--layers`` blocks (Linear(W, W) + LayerNorm(W): four gradients per block, three of
them small), trained with commsched (``dynamic``, cross-iteration) on ``--ranks`` gloo ranks over
loopback. Prints, per setting, the median step time, the process CPU per step (all threads) and
the tasks per step. A micro benchmark, not a timed test: compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import commsched
from commsched.config import parse_fusion
from commsched.plugins.torch import DistributedOptimizer


def model_of(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.LayerNorm(width))])


def run(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for fusion in args.fusion:
        for lean in args.lean:
            model = model_of(args.layers, args.width)
            config = commsched.SchedulerConfig(fusion_bytes=fusion, ordering="dynamic")
            opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model, backend="torch",
                                       config=config)
            opt._lean = lean
            x = torch.randn(args.batch, args.width)
            times, cpu0 = [], None
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    cpu0 = time.process_time()
                t0 = time.perf_counter()
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                times.append(time.perf_counter() - t0)
            opt.synchronize()
            cpu = (time.process_time() - cpu0) / args.steps
            tasks = opt.stats()["scheduler"]["tasks"] / max(1, opt.stats()["steps"])
            opt.close()
            rows.append((fusion, lean, statistics.median(times[args.warmup:]), cpu, tasks))
            dist.barrier()
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: "mp.Queue") -> None:
    out: dict = {}
    run(rank, world, port, args, out)
    if rank == 0:
        queue.put(out["rows"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--fusion", default="0,64KiB", help="comma-separated fusion_bytes values (0 = off)")
    ap.add_argument("--lean", default="on", choices=("on", "off", "both"))
    args = ap.parse_args(argv)
    args.fusion = [parse_fusion(v.strip()) for v in args.fusion.split(",")]
    args.lean = {"on": [True], "off": [False], "both": [False, True]}[args.lean]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_worker, args=(args.ranks, port, args, queue), nprocs=args.ranks, join=True)
    rows = queue.get(timeout=10)
    print(f"ranks={args.ranks} layers={args.layers} width={args.width} (tensors/step={4 * args.layers})")
    print("fusion_bytes  lean  step_ms  cpu_ms/step  tasks/step")
    for fusion, lean, step, cpu, tasks in rows:
        print(f"{fusion:>12}  {'on' if lean else 'off':>4}  {step * 1e3:7.2f}  {cpu * 1e3:11.2f}  {tasks:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
