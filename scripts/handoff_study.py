#!/usr/bin/env python3
"""What one piece in flight costs against four, beside a busy thread (docs/simulator.md,
"What `advise` recommends").

Two gloo ranks on the bench's emulated cluster (root: network namespaces, every link shaped to
``--bandwidth``). Each rank reduces one 32 MiB gradient through commsched's
``DistributedOptimizer`` (synchronous path) in 4 MiB pieces (``--piece-mb``), with a credit of one piece and of four,
for each ordering, while a thread of the same process keeps busy:

* ``--burn large``: 256x256 matrix products (torch kernels that release the GIL for long);
* ``--burn small``: 64x64 products (the GIL changes hands between short kernels);
* ``--burn python``: a pure Python loop (holds the GIL except at the switch interval);
* ``--burn none``.

It prints the median time of the reduction per ordering and depth, and the difference per piece.

    sudo python scripts/handoff_study.py --burn python [--switch-interval 0.0005] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

MIB = 1 << 20
TOTAL = 32 * MIB
ORDERINGS = ("fifo", "static", "dynamic")
DEPTHS = (1, 4)


def _burn(kind: str, stop: threading.Event) -> None:
    import torch

    a = torch.randn(256 if kind == "large" else 64, 256 if kind == "large" else 64)
    while not stop.is_set():
        if kind == "python":
            x = 0
            for i in range(20000):
                x += i
        else:
            for _ in range(20):
                a = torch.tanh(a @ a)


def _rank(rank: int, master: str, ifname: str, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(args.port), GLOO_SOCKET_IFNAME=ifname)
    import torch
    import torch.distributed as dist

    import commsched
    from commsched.plugins.torch import DistributedOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    stop = threading.Event()
    burner = threading.Thread(target=_burn, args=(args.burn, stop), daemon=True)
    if args.burn != "none":
        burner.start()
    results = {}
    for ordering in ORDERINGS:
        for depth in DEPTHS:
            torch.manual_seed(0)
            model = torch.nn.Linear(TOTAL // 4 // 4096, 4096, bias=False)  # TOTAL bytes of float32
            piece = int(args.piece_mb * MIB)
            config = commsched.SchedulerConfig(partition_bytes=piece, credit_bytes=piece * depth, ordering=ordering,
                                               cross_iteration=False, timeout_s=120)
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, backend="torch",
                                       config=config)
            x = torch.ones(1, model.in_features)
            times = []
            for _ in range(args.reps + 1):
                opt.zero_grad()
                model(x).sum().backward()
                dist.barrier()
                start = time.perf_counter()
                opt.synchronize()  # every piece reduced
                times.append(time.perf_counter() - start)
                opt.step()
            opt.close()
            results[f"{ordering}/{depth}"] = statistics.median(times[1:])  # the first sets up the group
    stop.set()
    if burner.is_alive():
        burner.join()  # a thread still inside a torch kernel at exit aborts the process
    if rank == 0:
        out = {"burn": args.burn, "switch_interval_s": args.switch_interval or sys.getswitchinterval(),
               "bandwidth": args.bandwidth, "piece_bytes": int(args.piece_mb * MIB), "total_bytes": TOTAL,
               "median_s": results}
        print(json.dumps(out))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burn", choices=("none", "large", "small", "python"), default="python")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval in each rank, seconds")
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--piece-mb", type=float, default=4.0, help="piece size in MiB (default 4; the credit is one "
                                                                   "piece or four)")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--json", default=None)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--master", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ifname", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.master, args.ifname, args)
        return 0
    from commsched.bench.netns import make_cluster

    passed = [a for a in sys.argv[1:] if a != "--json" and not a.endswith(".json")]
    with make_cluster("netns", 2, args.bandwidth) as cluster:
        nodes = cluster.nodes
        procs = [subprocess.Popen(node.wrap([sys.executable, __file__, *passed, "--rank", str(i), "--master",
                                             nodes[0].address, "--ifname", node.ifname]),
                                  stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL, text=True)
                 for i, node in enumerate(nodes)]
        try:
            out, _ = procs[0].communicate(timeout=900)
            for proc in procs[1:]:
                proc.wait(timeout=60)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    if procs[0].returncode != 0:
        print("handoff_study: rank 0 failed", file=sys.stderr)
        return 1
    result = json.loads(out.strip().splitlines()[-1])
    n = TOTAL // int(args.piece_mb * MIB)
    for ordering in ORDERINGS:
        one, four = (result["median_s"][f"{ordering}/{d}"] for d in DEPTHS)
        print(f"{ordering:8s} one in flight {one * 1e3:7.1f} ms, four {four * 1e3:7.1f} ms: "
              f"{(one - four) / n * 1e3:+.2f} ms a piece")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
