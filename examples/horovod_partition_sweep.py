"""How commsched's partition size and credit interact with Horovod's tensor fusion.

    HOROVOD_FUSION_THRESHOLD=0 horovodrun -np 2 -H localhost:2 --gloo \
        python examples/horovod_partition_sweep.py --json out/hvd_nofusion.json
    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_partition_sweep.py --json out/hvd_fusion.json

Trains an MLP (~17 MB of gradients) for a few steps per setting and reports the
median step time on rank 0, for `hvd.DistributedOptimizer` and for commsched with
backend="horovod" at several partition sizes and credits.
"""

import argparse
import json
import os
import statistics
import time

import horovod.torch as hvd
import torch
import torch.nn as nn

import commsched
from commsched.plugins.torch import DistributedOptimizer

MB = 1 << 20


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 2048), nn.ReLU(),
                         nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))


def measure(make_opt, steps: int) -> float:
    net = model()
    opt = make_opt(net)
    times = []
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        x, y = torch.randn(32, 1024, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    if hasattr(opt, "close"):
        opt.close()
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())  # one GPU per rank, not all on cuda:0
    torch.set_num_threads(1)
    rows = [{"setting": "hvd.DistributedOptimizer", "step_s": measure(
        lambda n: hvd.DistributedOptimizer(torch.optim.SGD(n.parameters(), lr=0.01),
                                           named_parameters=n.named_parameters()), args.steps)}]
    for part in (256 << 10, 1 * MB, 4 * MB, 64 * MB):
        for credit in (4 * MB, 16 * MB, 1024 * MB):
            cfg = commsched.SchedulerConfig(partition_bytes=part, credit_bytes=credit)
            step = measure(lambda n, cfg=cfg: DistributedOptimizer(torch.optim.SGD(n.parameters(), lr=0.01), n,
                                                                   backend="horovod", config=cfg), args.steps)
            rows.append({"setting": f"commsched partition={part // 1024}KiB credit={credit // MB}MiB",
                         "partition_bytes": part, "credit_bytes": credit, "step_s": step})
    if hvd.rank() == 0:
        fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD", "default (128 MiB)")
        print(f"HOROVOD_FUSION_THRESHOLD={fusion} HOROVOD_CYCLE_TIME={os.environ.get('HOROVOD_CYCLE_TIME', 'default')}")
        for r in rows:
            print(f"  {r['setting']:<45} {r['step_s'] * 1e3:8.1f} ms/step")
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump({"fusion_threshold": fusion, "rows": rows}, fh, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
