"""One rank: create, train and close DistributedOptimizers, recording the store's keys (rank 0 hosts it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import commsched
from commsched.plugins.torch import DistributedOptimizer

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--orderings", default="dynamic,static,fifo,auto")
ap.add_argument("--steps", type=int, default=12)
args = ap.parse_args()
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
torch.set_num_threads(1)
dist.barrier()
before = sorted(store.list_keys())
during = {}
for ordering in args.orderings.split(","):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    config = commsched.SchedulerConfig(partition_bytes=64, credit_bytes=256, ordering=ordering, timeout_s=30)
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, backend="torch",
                              config=config) as opt:
        for _ in range(args.steps):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        opt.synchronize()
        during[ordering] = sorted(store.list_keys())
    dist.barrier()  # every rank closed this optimizer
after = sorted(store.list_keys())
Path(args.out).write_text(json.dumps({"rank": dist.get_rank(), "before": before, "during": during, "after": after}))
dist.barrier()
dist.destroy_process_group()
