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


class TiedLM(nn.Module):
    """An embedding whose weight the output projection registers too (GPT-2's tie)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(40, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(idx))))


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


def run(name: str, steps: int, die_step: int, delay: float, two_level: int = 0, out: str = ".",
        tied: bool = False) -> dict:
    rank = hvd.rank()
    model, ref = (TiedLM(), TiedLM()) if tied else (build(), build())
    config = commsched.SchedulerConfig(partition_bytes=PARTITION, credit_bytes=CREDIT, timeout_s=20,
                                       fusion_bytes=0)  # pieces per tensor
    if two_level:
        plan = two_level_plan(model, two_level, os.path.join(out, f"plan-rank{rank}.json"))
        config = commsched.SchedulerConfig(ordering="planned", plan=plan, timeout_s=20)
    if tied:  # the head's part first in the step, the lookup's rows by Horovod's allgather
        config = commsched.SchedulerConfig(timeout_s=20, fusion_bytes=0)
    opt = DistributedOptimizer(OPTIMIZERS[name](model.parameters()), model, backend="horovod", config=config,
                               split_tied_embeddings=tied)
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
            if tied:
                x, y = torch.randint(0, 40, (4, 6), generator=g), torch.randint(0, 40, (4, 6), generator=g)
            else:
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            loss(model(x), y, tied).backward()
            if rank == 1 and step == die_step:
                os._exit(0)  # exit status 0, so that horovodrun does not kill rank 0 before it notices
            opt.step()
            if die_step >= 0:
                continue  # the reference would fail first; only commsched's error matters here
            ref_opt.zero_grad()
            loss(ref(x), y, tied).backward()
            ref_opt.step()
        opt.synchronize()
        pairs = list(zip(model.parameters(), ref.parameters(), strict=True))
        result["max_diff"] = max(float((p - q).detach().abs().max()) for p, q in pairs)
        # the split sums the lookup's rows in another order than one dense all-reduce: allclose, looser
        rtol, atol = (1e-5, 1e-6) if tied else (1e-6, 1e-7)
        result["allclose"] = all(torch.allclose(p, q, rtol=rtol, atol=atol)
                                 for p, q in zip(model.parameters(), ref.parameters(), strict=True))
        result["tied_embeddings"] = opt.stats().get("tied_embeddings")
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


def loss(out: torch.Tensor, y: torch.Tensor, tied: bool) -> torch.Tensor:
    if tied:
        return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return ((out - y) ** 2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--optimizers", default="sgd_momentum,adam")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--die-step", type=int, default=-1)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--two-level", type=int, default=0, help="nodes: run a plan of two-level pieces")
    ap.add_argument("--tied", action="store_true", help="a tied embedding, split_tied_embeddings=True")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hvd.init(process_sets="dynamic" if args.two_level else None)
    results = []
    for name in args.optimizers.split(","):
        results.append(run(name, args.steps, args.die_step, args.delay, args.two_level, args.out, args.tied))
        if "error" in results[-1]:
            break
    with open(os.path.join(args.out, f"rank{hvd.rank()}.json"), "w") as fh:
        json.dump(results, fh)
    hvd.shutdown()


if __name__ == "__main__":
    main()
