"""One rank of a multi-process test: trains with commsched and with plain synchronous
all-reduce side by side, and writes what it saw as JSON. Run by tests through
``conftest.run_ranks``; every scenario is selected by command-line flags."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import commsched
from commsched.order_check import is_check_name
from commsched.partition import piece_bounds
from commsched.plan import Plan, PlanGroup, PlannedPiece, PlannedTensor, fused_name
from commsched.plugins.torch import DistributedOptimizer

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    # two param groups with different learning rates (biases apart, as is common)
    "sgd_groups": lambda p: torch.optim.SGD(
        [{"params": [q for q in p if q.dim() > 1]}, {"params": [q for q in p if q.dim() <= 1], "lr": 0.2}],
        lr=0.05, momentum=0.9),
}


class MLP(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        self.to(dtype)

    def forward(self, x):
        return self.layers(x)


class Tied(nn.Module):
    """Embedding reused as the output layer (GPT-style tied weights)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)

    def forward(self, idx):
        h = torch.tanh(self.mix(self.embed(idx)))
        return h @ self.embed.weight.t()


class _Head(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.weight = embed.weight  # registered here too, as lm_head.weight = wte.weight

    def forward(self, h):
        return F.linear(h, self.weight)


class GPT(nn.Module):
    """Tied as GPT-2 and Hugging Face tie them: the head registers the embedding's weight (split_tied_embeddings
    finds it). ``use_unused`` (the alternate-branch scenarios' switch): False skips the head, so that step's
    weight gradient is the lookup's part alone."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16, padding_idx=0)
        self.mix = nn.Linear(16, 16)
        self.head = _Head(self.embed)
        self.use_unused = True

    def forward(self, idx):
        h = torch.tanh(self.mix(self.embed(idx)))
        return self.head(h) if self.use_unused else h


class Branchy(nn.Module):
    """A branch that is never used (or used only on some ranks, with --unused-on-rank)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)
        self.use_unused = False

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.head(h) + (self.unused(h) if self.use_unused else 0)


class Twin(nn.Module):
    """Two heads of one shape; rank 0 uses ``a``, the other ranks ``b`` (``use_b``): every rank submits the
    same number of same-sized gradients each step, of different tensors."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)
        self.use_b = False

    def forward(self, x):
        return (self.b if self.use_b else self.a)(torch.relu(self.trunk(x)))


def build(kind, dtype):
    torch.manual_seed(1234)
    return {"mlp": lambda: MLP(dtype), "tied": Tied, "gpt": GPT, "branchy": Branchy, "twin": Twin}[kind]()


def batch(kind, rank, step, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind in ("tied", "gpt"):
        return torch.randint(0, 50, (8, 6), generator=g), None
    x = torch.randn(8, 16, generator=g).to(dtype)
    return x, torch.randn(8, 4, generator=g).to(dtype)


def loss_of(kind, out, y):
    if kind in ("tied", "gpt"):
        return out.float().logsumexp(-1).mean()
    return ((out.float() - y.float()) ** 2).mean()


TIMEOUT_S = 20  # the scheduler's timeout_s; tests bound failure times by it

SCENARIO_DEFAULTS = dict(model="mlp", optimizer="sgd_momentum", ordering="dynamic", partition=256, credit=1024,
                         steps=10, cross=1, delay=0.0, dtype="float32", accum=1, lr_scheduler=False,
                         state_roundtrip=False, unused_on_rank=-1, timeline=None, no_sync=False,
                         die_rank=-1, die_step=-1, desync_init=False, plan=None, nodes=1, fusion=0,
                         alternate_branch=False, fast_tuner=False, priority="layer", slack_alpha=1.0,
                         auto_plan=False, plan_order="fixed", auto_sync_first=False, split_tied=False,
                         dp_groups=1, auto_reducer_first=False, plan_engine=0, verify_order=True)
PLAN_DIR = "."  # where planned scenarios write their plan files (next to --out)


def test_plan(model, sc: dict, rank: int, world: int) -> Plan:
    """A plan for the MLP as a planner would write one: the small tensors fused in two groups, each
    group cut at its own piece size, pieces interleaved (a fused group's pieces out of index order),
    ``algorithm`` for every piece on ``nodes`` x ``world // nodes``. ``sc['plan']``: ``"fused"``;
    ``"other_model"`` (made for a model whose layers.2.weight is 32x31); ``"differs_on_rank1"``
    (rank 1 has another credit). ``sc['plan_order']``: the plan's ``order`` (fixed, priority or observed);
    ``sc['plan_engine']`` > 0: the plan names DDP's engine with buckets of that many bytes."""
    params = dict(model.named_parameters())
    entries = [PlannedTensor(n, p.numel(), p.element_size(), tuple(p.shape), str(p.dtype).removeprefix("torch."))
               for n, p in params.items()]
    if sc["plan"] == "other_model":
        entries = [PlannedTensor(t.name, 32 * 31, t.element_size, (32, 31), t.dtype) if t.name == "layers.2.weight"
                   else t for t in entries]
    low = ("layers.0.bias", "layers.2.bias")
    head = ("layers.4.weight", "layers.4.bias")
    # the head's pieces have 65 elements: padded by the two-level algorithm on 2 ranks per node
    groups = (PlanGroup("layers.0.weight", ("layers.0.weight",), 512), PlanGroup(fused_name(low), low, 4096),
              PlanGroup("layers.2.weight", ("layers.2.weight",), 1024), PlanGroup(fused_name(head), head, 260))
    algorithm = "hierarchical" if sc["nodes"] > 1 else "ring"
    by = {t.name: t for t in entries}

    def n_pieces(g):
        return len(piece_bounds(sum(by[t].numel for t in g.tensors), by[g.tensors[0]].element_size,
                                g.partition_bytes))
    counts = {g.name: n_pieces(g) for g in groups}
    # backward-ish interleaving: the head's pieces out of index order, then layer 2, then layer 0 and its bias
    order = ([(fused_name(head), i) for i in reversed(range(counts[fused_name(head)]))]
             + [("layers.2.weight", i) for i in range(counts["layers.2.weight"])]
             + [(fused_name(low), 0)] + [("layers.0.weight", i) for i in range(counts["layers.0.weight"])])
    credit = sc["credit"] * (2 if sc["plan"] == "differs_on_rank1" and rank == 1 else 1)
    topology = {}
    if sc["plan_order"] == "observed":  # rank 0 reorders the recorded step on this link (edd_replay_order)
        from commsched.costmodel.topology import Topology
        topology = Topology.emulated(world, sc["nodes"] if sc["nodes"] > 1 else None, "1gbit").to_dict()
    return Plan(model=tuple(entries), groups=groups, pieces=tuple(PlannedPiece(t, i, algorithm) for t, i in order),
                credit_bytes=credit, nodes=sc["nodes"], ranks_per_node=world // sc["nodes"], order=sc["plan_order"],
                topology=topology, **({"engine": "reducer", "bucket_bytes": sc["plan_engine"]} if sc["plan_engine"]
                                      else {}))


def run_scenario(sc: dict, rank: int, world: int, ref_group) -> dict:
    """Train ``sc['steps']`` steps with commsched and with plain synchronous all-reduce; compare.

    ``sc['dp_groups']`` > 1: the job's ranks form that many data-parallel groups (rank r in group
    r % dp_groups), each training its own replica on ``process_group=`` its group, against a reference
    that all-reduces on that same group."""
    dtype = getattr(torch, sc["dtype"])
    result: dict = {}
    process_group = None
    if sc["dp_groups"] > 1:
        members = [[r for r in range(world) if r % sc["dp_groups"] == g] for g in range(sc["dp_groups"])]
        mine = rank % sc["dp_groups"]
        groups = [dist.new_group(m, backend="gloo") for m in members]  # every rank makes every group, in order
        # the reference all-reduces on the user's group itself while commsched's pieces are in flight:
        # commsched must communicate on a twin of it, or the two would interleave differently per rank
        process_group = ref_group = groups[mine]
        world = len(members[mine])
        result["group_ranks"] = members[mine]
    model, ref = build(sc["model"], dtype), build(sc["model"], dtype)
    if sc["desync_init"]:  # ranks start from different weights: the broadcast must fix that
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank + 1.0)
    if sc["model"] == "branchy" and sc["unused_on_rank"] == rank:
        model.use_unused = ref.use_unused = True
    if sc["model"] == "twin":
        model.use_b = ref.use_b = rank != 0
    plan = plan_path = None
    if sc["plan"]:
        plan = test_plan(model, sc, rank, world)
        plan_path = os.path.join(PLAN_DIR, f"plan-{sc['plan']}-rank{rank}.json")
        plan.to_json(plan_path)
    config = commsched.SchedulerConfig(partition_bytes=sc["partition"], credit_bytes=sc["credit"],
                                       ordering="planned" if plan else sc["ordering"], plan=plan_path,
                                       cross_iteration=bool(sc["cross"]), timeout_s=TIMEOUT_S, timeline=sc["timeline"],
                                       fusion_bytes=sc["fusion"], priority=sc["priority"],
                                       slack_alpha=sc["slack_alpha"], verify_order=sc["verify_order"])
    from commsched.plugins.torch import optimizer as optimizer_module
    # "planned" without a plan: its plan stays on commsched's pieces (whether the tiny MLP's communication looks
    # hidden to the model depends on this machine's timing; a plan naming the reducer has scenarios of its own)
    optimizer_module.PLAN_REDUCER_BUCKETS = ()
    if sc["fast_tuner"]:  # ordering="auto" in few steps: 1 settle + 2 scored steps per sample, 6 samples,
        # the last 3 at most a race of one fresh sample each of the incumbent and up to two runners-up (the
        # plugin's race_width and race_margin)
        from commsched.plugins.torch import optimizer as optimizer_module
        optimizer_module.TUNER_OPTIONS.update(sample_steps=2, settle=1, max_samples=6, check_every=4, race_samples=1)
        # auto_plan: the planner's plan is a start whatever its predicted gain (measured first)
        optimizer_module.AUTO_PLAN_MIN_GAIN = -1.0 if sc["auto_plan"] else None
        import commsched.tuner as tuner_module
        # the model weighs no reducer buckets here: whether it sees the tiny MLP's communication hidden (and then
        # favours the reducer instead of measuring a plan) depends on this machine's timing, as for "planned"
        # above; the favour has a test of its own (test_reducer.py)
        optimizer_module.model_starts = lambda *a, **k: tuner_module.model_starts(*a, **{**k, "reducer_buckets": ()})
        if sc["auto_sync_first"]:  # the model's only start: plain fifo on the synchronous path; then the
            # config's own dynamic (cross-iteration): the path changes twice, both within the starts
            from commsched.tuner import UNLIMITED_BYTES, ModelStarts, Settings
            sync = Settings("fifo", UNLIMITED_BYTES, UNLIMITED_BYTES, sc["fusion"], cross_iteration=False)
            optimizer_module.model_starts = lambda *a, **k: ModelStarts([sync], {}, ["test: synchronous first"])
        if sc["auto_reducer_first"]:  # the model's only start: torch's reducer with 4 KiB buckets (several)
            from commsched.tuner import REDUCER, UNLIMITED_BYTES, ModelStarts, Settings
            red = Settings(REDUCER, UNLIMITED_BYTES, UNLIMITED_BYTES, 4096, cross_iteration=False)
            optimizer_module.model_starts = lambda *a, **k: ModelStarts([red], {}, ["test: torch's reducer first"])
    started = time.monotonic()
    opt = None
    try:
        topology = None
        if sc["ordering"] == "auto" and sc["nodes"] > 1:  # the tuner's model sees two nodes behind a slow link
            from commsched.costmodel.topology import Link, Topology
            topology = Topology(nodes=sc["nodes"], ranks_per_node=world // sc["nodes"], intra=Link(50e-6, 2e9),
                                inter=Link(50e-6, 1e4))  # very slow: the gradient dominates
        opt = DistributedOptimizer(OPTIMIZERS[sc["optimizer"]](list(model.parameters())), model, backend="torch",
                                   config=config, backward_passes_per_step=1 if sc["no_sync"] else sc["accum"],
                                   topology=topology, split_tied_embeddings=sc["split_tied"],
                                   process_group=process_group)
        result["hierarchical_threads"] = sum(t.name.startswith("commsched-hier-") for t in threading.enumerate())
        if sc["desync_init"]:  # the reference starts from rank 0's weights, as commsched broadcast them
            ref.load_state_dict(model.state_dict())
        ref_opt = OPTIMIZERS[sc["optimizer"]](list(ref.parameters()))
        sched = ref_sched = None
        if sc["lr_scheduler"]:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
        rng = random.Random(rank * 7919)
        grads_kept: list[bool] = []
        grads_after_step: list[bool] = []
        if sc["delay"] > 0:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda p: time.sleep(rng.random() * sc["delay"]))
        for step in range(sc["steps"]):
            if sc["alternate_branch"]:  # the unused branch runs on even steps only, on every rank
                model.use_unused = ref.use_unused = step % 2 == 0
            if step == sc["die_step"]:
                result["die_step_started"] = time.monotonic()
            opt.zero_grad()
            ref_opt.zero_grad()
            for micro in range(sc["accum"]):
                x, y = batch(sc["model"], rank, step * sc["accum"] + micro, dtype)
                last = micro == sc["accum"] - 1
                ctx = opt.no_sync() if (sc["no_sync"] and not last) else contextlib.nullcontext()
                with ctx:
                    loss_of(sc["model"], model(x), y).backward()
                loss_of(sc["model"], ref(x), y).backward()
            if rank == sc["die_rank"] and step == sc["die_step"]:
                os._exit(3)  # a rank dies mid-training, with pieces in flight
            # which path ran: cross-iteration takes every p.grad in backward, the synchronous one leaves it
            grads_kept.append(any(p.grad is not None for p in model.parameters()))
            opt.step()
            grads_after_step.append(any(p.grad is not None for p in model.parameters()))
            if sc["unused_on_rank"] >= 0 or sc["die_rank"] >= 0 or sc["model"] == "twin":
                continue  # the reference would mismatch in its own all-reduces; only the error matters
            for p in ref.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=ref_group)
                    p.grad.div_(world)
            ref_opt.step()
            if sched is not None:
                sched.step()
                ref_sched.step()
            if sc["state_roundtrip"] and step == sc["steps"] // 2:
                saved = opt.state_dict()
                opt.load_state_dict(saved)
                result["state_equal_format"] = (
                    sorted(saved["state"].keys()) == sorted(ref_opt.state_dict()["state"].keys())
                    and saved["param_groups"][0].keys() == ref_opt.state_dict()["param_groups"][0].keys())
        opt.synchronize()
        diffs = {}
        bitwise = True
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            diffs[name] = float((p.detach().double() - q.detach().double()).abs().max())
            bitwise &= bool(torch.equal(p, q))
        stats = opt.stats()
        # what partitioning must give: piece_bounds' count for every tensor that has a gradient (the
        # reference's grads stay; commsched's may be None here, taken over by cross-iteration)
        expected_pieces = {name: len(piece_bounds(q.numel(), q.element_size(), sc["partition"]))
                           for name, q in ref.named_parameters() if q.grad is not None}
        fused = stats["fused"]  # fusion_bytes: each group is one task over its members' total size
        for group, members in fused.items():
            for m in members:
                expected_pieces.pop(m, None)
            numel = sum(dict(ref.named_parameters())[m].numel() for m in members)
            expected_pieces[group] = len(piece_bounds(numel, dict(ref.named_parameters())[members[0]].element_size(),
                                                      sc["partition"]))
        if sc["alternate_branch"] or sc["ordering"] == "auto" or (sc["ordering"] == "planned" and not plan):
            expected_pieces = None  # the tasks differ between steps (branches taken; settings switched)
        if plan is not None:  # the plan cuts each group at its own size
            expected_pieces = {g.name: len(plan.bounds(g)) for g in plan.groups}
            result["plan_order"] = list(plan.piece_names)
        if stats["engine"] == "torch-reducer":  # the plan named DDP's engine: commsched's scheduler idles now
            expected_pieces = None
        # the check that ends each fifo step (commsched.order_check) apart from the gradients' pieces: for each
        # step, whether exactly one check ran in it, last
        order = stats["scheduler"]["per_step"]
        result["order_checked"] = {step: [n for n in seen["order"] if is_check_name(n)] == seen["order"][-1:]
                                   for step, seen in order.items()}
        order = {step: dict(seen, order=[n for n in seen["order"] if not is_check_name(n)])
                 for step, seen in order.items()}
        digest = hashlib.sha256()
        for p in model.parameters():
            digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())  # bfloat16 too
        result.update(bitwise=bitwise, param_sha256=digest.hexdigest(), max_diff=max(diffs.values()), diffs=diffs,
                      stats={k: v for k, v in stats.items() if k != "scheduler"},
                      order=order, lr=opt.param_groups[0]["lr"],
                      expected_pieces=expected_pieces, grads_kept=grads_kept, grads_after_step=grads_after_step,
                      max_in_flight_bytes=stats["scheduler"]["max_in_flight_bytes"])
    except Exception as exc:  # reported to the test, which asserts on it
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["error_type"] = type(exc).__name__
        result["error_after_start_s"] = time.monotonic() - started
        result["error_is_commsched"] = isinstance(exc, commsched.CommschedError)
        if "die_step_started" in result:  # from the step in which the other rank died
            result["error_after_s"] = time.monotonic() - result["die_step_started"]
            result["timeout_s"] = TIMEOUT_S
    finally:
        try:
            if opt is not None:
                opt.close()
        except Exception as exc:
            result.setdefault("error", f"{type(exc).__name__}: {exc}")
    result["threads_after_close"] = [t.name for t in threading.enumerate() if t.name.startswith("commsched")]
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenario", action="append", default=[], help="JSON dict of SCENARIO_DEFAULTS overrides")
    args = ap.parse_args()
    global PLAN_DIR
    PLAN_DIR = os.path.dirname(os.path.abspath(args.out))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_group = dist.new_group(backend="gloo")  # the reference's all-reduces, apart from commsched's
    results = []
    for raw in args.scenario or ["{}"]:
        sc = dict(SCENARIO_DEFAULTS, **json.loads(raw))
        results.append(dict(run_scenario(sc, rank, world, ref_group), scenario=sc, rank=rank))
        if "error" in results[-1]:
            break  # the process group may be unusable now
    with open(args.out, "w") as fh:
        json.dump(results, fh, default=str)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
