"""Where a step of Horovod's synthetic-benchmark shape goes: forward, backward, step(), and the
process's CPU per step, for hvd.DistributedOptimizer and commsched's one-line replacement.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_step_breakdown.py --dist commsched

Same model, data and optimizer as examples/horovod_synthetic_benchmark.py; instead of timeit over
batches it times every phase of every step and prints medians on rank 0 (robust to the outliers a
shared machine produces), the img/s of the median step, and commsched's pieces per step.
``COMMSCHED_PARTITION_BYTES`` and the other ``COMMSCHED_*`` variables apply as usual.
"""

import argparse
import statistics
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.optim as optim
from horovod_synthetic_benchmark import small_cnn

import commsched.plugins.torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", choices=["hvd", "commsched", "commsched-model"], default="commsched")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = small_cnn(args.width)
    optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    kwargs = dict(named_parameters=model.named_parameters(), compression=hvd.Compression.none, op=hvd.Average)
    if args.dist == "hvd":
        optimizer = hvd.DistributedOptimizer(optimizer, **kwargs)
    else:
        extra = {"model": model} if args.dist == "commsched-model" else {}
        optimizer = commsched.plugins.torch.DistributedOptimizer(optimizer, **kwargs, **extra)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    data = torch.randn(args.batch_size, 3, 32, 32, generator=gen)
    target = torch.randint(0, 10, (args.batch_size,), generator=gen)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "total": []}
    cpu_start = 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            cpu_start = time.process_time()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if i >= args.warmup:
            for name, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                phases[name].append(value)
    cpu_ms = (time.process_time() - cpu_start) / args.steps * 1e3
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    if hvd.rank() == 0:
        medians = {name: statistics.median(values) for name, values in phases.items()}
        stats = optimizer.stats() if hasattr(optimizer, "stats") else None
        pieces = f"{stats['pieces'] / max(1, stats['steps']):.1f}" if stats else "-"
        print(f"{args.dist}: " + " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items())
              + f"; img/s per worker {args.batch_size / medians['total']:.1f}; CPU per step {cpu_ms:.1f} ms "
              f"(all threads); pieces per step {pieces}", flush=True)
    if hasattr(optimizer, "close"):
        optimizer.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
