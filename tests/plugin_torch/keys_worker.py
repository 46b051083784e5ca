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
ap.add_argument("--orderings", default="dynamic,static,fifo,auto,dynamic+tied")
ap.add_argument("--steps", type=int, default=12)
args = ap.parse_args()
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
torch.set_num_threads(1)
dist.barrier()
before = sorted(store.list_keys())
during = {}

class TiedLM(torch.nn.Module):
    """An embedding whose weight the head registers too: the split adds a process group of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 16)
        self.head = torch.nn.Linear(16, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


for name in args.orderings.split(","):
    torch.manual_seed(0)
    ordering, _, tied = name.partition("+")
    model = TiedLM() if tied else torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    config = commsched.SchedulerConfig(partition_bytes=64, credit_bytes=256, ordering=ordering, timeout_s=30)
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, backend="torch",
                              config=config, split_tied_embeddings=bool(tied)) as opt:
        for _ in range(args.steps):
            opt.zero_grad()
            x = torch.randint(0, 8, (4, 3)) if tied else torch.randn(4, 8)
            model(x).sum().backward()
            opt.step()
        opt.synchronize()
        during[name] = sorted(store.list_keys())
    dist.barrier()  # every rank closed this optimizer
after = sorted(store.list_keys())
Path(args.out).write_text(json.dumps({"rank": dist.get_rank(), "before": before, "during": during, "after": after}))
dist.barrier()
dist.destroy_process_group()
