"""One Horovod rank (under horovodrun): commsched with backend="horovod" against
hvd.DistributedOptimizer on the same data; writes JSON to --out/rank<r>.json."""

from __future__ import annotations

import argparse
import json
import os
import threading

import horovod.torch as hvd
import torch
import torch.nn as nn

import commsched
from commsched.partition import piece_bounds
from commsched.plan import Plan, PlanGroup, PlannedPiece, PlannedTensor
from commsched.plugins.torch import DistributedOptimizer

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
}


PARTITION, CREDIT = 256, 512  # every weight is split; rank 0 queues pieces behind the credit


def build():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def two_level_plan(model: nn.Module, nodes: int, path: str) -> str:
    """A plan with every piece two-level on ``nodes`` x ``size // nodes``, each tensor cut at 63
    elements (odd lengths: the reduce-scatter pads them), in reverse registration order."""
    entries = [PlannedTensor(n, p.numel(), p.element_size(), tuple(p.shape), str(p.dtype).removeprefix("torch."))
               for n, p in model.named_parameters()]
    groups = tuple(PlanGroup(t.name, (t.name,), 63 * 4) for t in entries)
    pieces = tuple(PlannedPiece(t.name, i, "hierarchical") for t in reversed(entries)
                   for i in range(len(piece_bounds(t.numel, t.element_size, 63 * 4))))
    Plan(model=tuple(entries), groups=groups, pieces=pieces, credit_bytes=CREDIT, nodes=nodes,
         ranks_per_node=hvd.size() // nodes).to_json(path)
    return path


def run(name: str, steps: int, die_step: int, delay: float, two_level: int = 0, out: str = ".") -> dict:
    rank = hvd.rank()
    model, ref = build(), build()
    config = commsched.SchedulerConfig(partition_bytes=PARTITION, credit_bytes=CREDIT, timeout_s=20,
                                       fusion_bytes=0)  # pieces per tensor
    if two_level:
        plan = two_level_plan(model, two_level, os.path.join(out, f"plan-rank{rank}.json"))
        config = commsched.SchedulerConfig(ordering="planned", plan=plan, timeout_s=20)
    opt = DistributedOptimizer(OPTIMIZERS[name](model.parameters()), model, backend="horovod", config=config)
    ref_opt = hvd.DistributedOptimizer(OPTIMIZERS[name](ref.parameters()), named_parameters=ref.named_parameters())
    hvd.broadcast_parameters(ref.state_dict(), root_rank=0)
    result: dict = {"rank": rank, "optimizer": name}
    if delay:  # ranks see gradients become ready in different orders
        import random
        import time

        rng = random.Random(rank)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: time.sleep(rng.random() * delay))
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            if rank == 1 and step == die_step:
                os._exit(0)  # exit status 0, so that horovodrun does not kill rank 0 before it notices
            opt.step()
            if die_step >= 0:
                continue  # the reference would fail first; only commsched's error matters here
            ref_opt.zero_grad()
            ((ref(x) - y) ** 2).mean().backward()
            ref_opt.step()
        opt.synchronize()
        pairs = list(zip(model.parameters(), ref.parameters(), strict=True))
        result["max_diff"] = max(float((p - q).detach().abs().max()) for p, q in pairs)
        result["allclose"] = all(torch.allclose(p, q, rtol=1e-6, atol=1e-7)
                                 for p, q in zip(model.parameters(), ref.parameters(), strict=True))
        sched = opt.stats()["scheduler"]
        result["pieces"] = sched["pieces"]
        result["order"] = sched["per_step"]
        result["max_in_flight_bytes"] = sched["max_in_flight_bytes"]
        result["expected_pieces"] = {name: len(piece_bounds(q.numel(), q.element_size(), PARTITION))
                                     for name, q in ref.named_parameters()}
        result["credit"] = CREDIT
        two = opt._backend._two_level
        result["two_level"] = None if two is None else [two.nodes, two.ranks_per_node, two.node_set.ranks,
                                                        two.cross_set.ranks, two.pieces]
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["error_is_commsched"] = isinstance(exc, commsched.CommschedError)
    finally:
        try:
            opt.close()
        except Exception as exc:
            result.setdefault("error", f"{type(exc).__name__}: {exc}")
    result["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("commsched")]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default="sgd_momentum,adam")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--die-step", type=int, default=-1)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--two-level", type=int, default=0, help="nodes: run a plan of two-level pieces")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init(process_sets="dynamic" if args.two_level else None)
    results = []
    for name in args.optimizers.split(","):
        results.append(run(name, args.steps, args.die_step, args.delay, args.two_level, args.out))
        if "error" in results[-1]:
            break
    with open(os.path.join(args.out, f"rank{hvd.rank()}.json"), "w") as fh:
        json.dump(results, fh)
    hvd.shutdown()


if __name__ == "__main__":
    main()
