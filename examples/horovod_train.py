"""Horovod users swap one line: hvd.DistributedOptimizer(...) -> DistributedOptimizer(opt, model, backend="horovod").

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_train.py [--steps 20]
"""

import argparse

import horovod.torch as hvd
import torch
import torch.nn as nn

import commsched
from commsched.plugins.torch import DistributedOptimizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())  # one GPU per rank, not all on cuda:0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))
    # was: opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model,
                               backend="horovod", config=commsched.SchedulerConfig(partition_bytes=64 << 10))
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(args.steps):
        x, y = torch.randn(32, w, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    opt.synchronize()
    stats = opt.stats()
    if hvd.rank() == 0:
        print(f"horovod x{hvd.size()}: final loss {loss.item():.4f}, {stats['pieces']} pieces, "
              f"mean bubble {sum(stats['bubble_s']) / len(stats['bubble_s']) * 1e3:.1f} ms/step")
    opt.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
