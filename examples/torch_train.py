"""Train a small MLP with commsched on every rank.

    torchrun --standalone --nproc_per_node=2 examples/torch_train.py [--steps 30] [--no-cross-iteration]

Prints, on rank 0, what the scheduler did: pieces per step, the order of the
first pieces, and the bubble (seconds the forward or step() waited for
communication) per step.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import commsched
from commsched.plugins.torch import DistributedOptimizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--no-cross-iteration", action="store_true")
    ap.add_argument("--ordering", default="dynamic", choices=["dynamic", "static", "fifo"])
    ap.add_argument("--json", help="write rank 0's opt.stats() here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        # Before init_process_group: otherwise every rank's NCCL communicator (and
        # commsched's communication stream) lands on cuda:0.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(w, w), nn.ReLU())], nn.Linear(w, 10)).to(device)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, backend="torch",
                               config=commsched.SchedulerConfig(partition_bytes=256 << 10, credit_bytes=1 << 20,
                                                                ordering=args.ordering,
                                                                cross_iteration=not args.no_cross_iteration))
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(64, w, generator=gen).to(device)
        y = torch.randint(0, 10, (64,), generator=gen).to(device)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # returns at once; the next forward waits layer by layer
    opt.synchronize()  # every parameter final
    stats = opt.stats()
    if dist.get_rank() == 0:
        bubbles = stats["bubble_s"][1:]  # step 0 has no previous step to overlap with
        last = stats["scheduler"]["per_step"][max(stats["scheduler"]["per_step"], key=int)]
        print(f"final loss {loss.item():.4f}; cross_iteration={not args.no_cross_iteration} ordering={args.ordering}")
        print(f"pieces {stats['pieces']} ({stats['bytes'] / 2**20:.1f} MiB); last step {last['pieces']} pieces, "
              f"first ones: {', '.join(last['order'][:4])}")
        print(f"bubble per step: mean {sum(bubbles) / max(1, len(bubbles)) * 1e3:.1f} ms, "
              f"max {max(bubbles, default=0) * 1e3:.1f} ms over {len(bubbles)} steps")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({k: v for k, v in stats.items() if k != "priorities"}, fh, indent=1, default=str)
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
