"""PyTorch's DDP tutorial shape (examples/ddp_tutorial.py) moved to commsched with the change of
docs/quickstart.md ("torchrun + DDP"): DDP dropped, the optimizer wrapped (and the import).
tests/plugin_torch/test_example.py checks that this file differs from the stock one by exactly
that diff, that the checkpoint rank 0 saves loads on every rank, that the ranks then agree, and
that the checkpoint equals the stock script's.

    torchrun --standalone --nproc_per_node=2 examples/ddp_tutorial_commsched.py --checkpoint /tmp/cs.pt

Nothing else changes: ``model.state_dict()`` and ``load_state_dict()`` apply the last step's
update first (the cross-iteration overlap would otherwise leave it for the next forward), so the
checkpoint lines stay as they were.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from commsched.plugins.torch import DistributedOptimizer


def setup() -> torch.device:
    """One process per device: a GPU each under NCCL where there are GPUs, else the CPU under gloo."""
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(32, 64)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(256, 32, generator=data), torch.randint(0, 5, (256,), generator=data))
    sampler = DistributedSampler(dataset)  # each rank its own shard, reshuffled per epoch
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = ToyModel().to(device)
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            torch.save(model.state_dict(), args.checkpoint)

    dist.barrier()  # the checkpoint is written before any rank reads it
    map_location = {"cuda:0": f"cuda:{device.index}"} if device.type == "cuda" else "cpu"
    model.load_state_dict(torch.load(args.checkpoint, map_location=map_location, weights_only=True))
    with torch.no_grad():  # evaluate what was loaded, on every rank
        inputs, targets = dataset.tensors
        eval_loss = F.cross_entropy(model(inputs.to(device)), targets.to(device)).item()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"loaded": True, "world": world, "loss": loss.item(), "eval_loss": eval_loss,
                       "ranks_equal": all(torch.equal(g, gathered[0]) for g in gathered)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
