"""Horovod's own ``pytorch_synthetic_benchmark.py`` shape, with commsched as a one-line change.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_synthetic_benchmark.py --dist commsched

``--dist hvd`` runs the script as Horovod ships it (``hvd.DistributedOptimizer``);
``--dist commsched`` replaces that one line by ``commsched.plugins.torch.DistributedOptimizer``
with the same arguments; ``--dist commsched-model`` also passes ``model=model``
(cross-iteration overlap). Everything else — ``hvd.broadcast_parameters``,
``hvd.broadcast_optimizer_state``, the ``timeit`` loop over
zero_grad/forward/backward/step — is Horovod's script. The model is a small CNN
(no torchvision here). Rank 0 prints img/sec and, with ``--json``, writes the
figures and the final parameters' checksum; ``--save`` writes the final parameters.
"""

import argparse
import json
import timeit

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import commsched.plugins.torch


def small_cnn(width: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 8 * 8, 512), nn.ReLU(), nn.Linear(512, classes))


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark (Horovod's shape)")
    parser.add_argument("--dist", choices=["hvd", "commsched", "commsched-model"], default="commsched")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())  # one GPU per rank, not all on cuda:0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = small_cnn(args.width)
    optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    compression = hvd.Compression.none
    if args.dist == "hvd":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression, op=hvd.Average,
                                             gradient_predivide_factor=args.gradient_predivide_factor)
    elif args.dist == "commsched":  # the one changed line
        optimizer = commsched.plugins.torch.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression, op=hvd.Average,
            gradient_predivide_factor=args.gradient_predivide_factor)
    else:  # and with model=: the next forward overlaps this step's communication
        optimizer = commsched.plugins.torch.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression, op=hvd.Average,
            gradient_predivide_factor=args.gradient_predivide_factor, model=model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    data = torch.randn(args.batch_size, 3, 32, 32, generator=gen)
    target = torch.randint(0, 10, (args.batch_size,), generator=gen)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for _ in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_secs.append(args.batch_size * args.num_batches_per_iter / t)
    if args.dist == "commsched-model":
        optimizer.synchronize()  # cross-iteration: the last step's update lands in the next forward
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="final_params")
    ranks_equal = bool(torch.equal(gathered[0], gathered[-1]))
    stats = optimizer.stats() if hasattr(optimizer, "stats") else None
    if hvd.rank() == 0:
        mean = float(np.mean(img_secs))
        print(f"{args.dist}: img/sec per worker {mean:.1f} +-{1.96 * float(np.std(img_secs)):.1f}; "
              f"total on {hvd.size()} workers {hvd.size() * mean:.1f}; ranks equal: {ranks_equal}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"dist": args.dist, "img_sec_per_worker": mean, "img_secs": img_secs,
                           "size": hvd.size(), "ranks_equal": ranks_equal,
                           "backend": getattr(optimizer, "backend", "hvd"),
                           "steps_counted": stats["steps"] if stats else None,
                           "pieces": stats["pieces"] if stats else None,
                           "state_keys": sorted({k for s in optimizer.state_dict()["state"].values() for k in s})},
                          f)
        if args.save:
            torch.save(flat, args.save)
    if hasattr(optimizer, "close"):
        optimizer.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
