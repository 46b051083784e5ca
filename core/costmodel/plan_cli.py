"""``commsched plan``: search the communication plan of a model on a topology.

``commsched plan --profile P --topology T --json plan.json`` (or ``--workload W``,
``--model M``; ``--workers/--nodes/--bandwidth`` or ``--cluster`` as ``commsched
simulate``) writes the plan that ``SchedulerConfig(ordering="planned", plan=...)``
executes, and prints what each stage of the search gained, the solver's status and
gap, and the simulated step of the plan beside the other strategies.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commsched.costmodel.cli import add_source_arguments, load_profile, load_topology
from commsched.costmodel.planner import PLAN_STAGES, PlanResult, PlanSearch, make_plan
from commsched.costmodel.profile import Profile
from commsched.costmodel.simulator import SimSettings, simulate
from commsched.costmodel.topology import Topology
from commsched.plan import ORDERS
from commsched.progress import Progress

__all__ = ["add_plan_arguments", "plan_markdown", "run_plan"]

MB = 1 << 20
COMPARE = "ddp,ddp:4,horovod,dynamic,hierarchical"


def _sizes(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(float(v) * MB) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v < 0 for v in values):
        raise ValueError(f"{flag} {text!r} must be comma-separated sizes in MB, e.g. 0.25,1,4")
    return values


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--json", required=True, help="write the plan here (load it with "
                                                 "SchedulerConfig(ordering='planned', plan=PATH))")
    p.add_argument("--time-limit", type=float, default=10.0,
                   help="seconds for the MILP solves together (default 10); the gap at the limit is reported")
    p.add_argument("--partitions-mb", default=None, help="piece sizes to search, MB (default 0.25,1,4,16,64)")
    p.add_argument("--credits-mb", default=None, help="credits to search, MB (default 1,4,16,64)")
    p.add_argument("--fusions-mb", default=None, help="fusion thresholds to search, MB; 0 = none "
                                                      "(default 0,0.25,1,4)")
    p.add_argument("--reducer-mb", default=None,
                   help="bucket sizes, MB, at which DDP's own engine is weighed: where its shape already hides the "
                        "communication in the model and the search gains no more than --min-gain on it, the plan "
                        "names the framework's reducer (default 1,4; 'none': always commsched's pieces)")
    p.add_argument("--kept-default-order", choices=ORDERS, default=PlanSearch.kept_default_order,
                   help="where the plan is the runtime default's settings (no gain past --min-gain): issue its "
                        "pieces by priority for 3 steps, then every step in one order made from the third step's "
                        "readiness (observed: as static, with no message a step; the default), in the runtime's "
                        "priority order decided every step (priority: what dynamic runs), or as the simulated order "
                        "(fixed)")
    p.add_argument("--min-gain", type=float, default=0.05,
                   help="keep the runtime default (1 MiB pieces, 4 MiB credit, fusion 256 KiB, ring) unless the "
                        "best plan is predicted this share faster (default 0.05, the model's error; 0 = take any gain)")
    p.add_argument("--compare", default=COMPARE, help=f"strategies simulated beside the plan (default {COMPARE})")
    p.add_argument("--split-tied", action="store_true",
                   help="plan for DistributedOptimizer(split_tied_embeddings=True): the profile's tied embedding "
                        "(Profile.tied) ready when the output projection made it, not at the end of backward")


def plan_markdown(result: PlanResult, profile: Profile, topology: Topology, compare: list[str]) -> str:
    plan = result.plan
    fused = [g for g in plan.groups if g.fused]
    algorithms = sorted({p.algorithm for p in plan.pieces})
    lines = [f"# plan for {profile.source} on {topology.describe()}", "",
             f"{len(plan.pieces)} pieces in {len(plan.groups)} groups ({len(fused)} fused, "
             f"{sum(len(g.tensors) for g in fused)} tensors in them), credit {plan.credit_bytes / MB:g} MiB, "
             f"algorithms {', '.join(algorithms)}, order {plan.order}; {_engine(plan)}; digest {plan.digest[:12]}; "
             f"searched {result.candidates} candidates in {result.seconds:.1f} s", "",
             "| stage | simulated step s | gain s | what |", "|---|---:|---:|---|"]
    for stage in result.stages:
        gain = stage.get("gain_s")
        lines.append(f"| {stage['stage']} | {stage['step_time_s']:.4f} | "
                     f"{'' if gain is None else f'{gain:+.4f}'} | {stage['what']} |")
    s = result.solver
    gap = s.get("gap")
    lines += ["", f"solver: {s.get('solver')} — {s.get('status')}, {s.get('units')} units, {s.get('binaries')} "
              f"binaries, objective {s.get('objective_s', float('nan')):.4f} s, bound "
              f"{s.get('bound_s', float('nan')):.4f} s, gap {'n/a' if gap is None else f'{gap:.1%}'}, "
              f"{s.get('seconds', 0):.1f} s (limit {s.get('time_limit_s', 0):g} s). The MILP's own model ignores "
              "compute slowed by communication; every candidate is scored by the simulator.", ""]
    settings = SimSettings()
    rows = [(name, simulate(profile, topology, name, settings)) for name in compare]
    rows.append(("planned", result.predicted))
    ddp = next((r for name, r in rows if name == "ddp"), None)
    lines += ["| strategy | simulated step s | exposed comm s | overlap | vs ddp |", "|---|---:|---:|---:|---:|"]
    for name, r in rows:
        speed = f"{ddp.step_time_s / r.step_time_s:.2f}x" if ddp else "-"
        lines.append(f"| {name} | {r.step_time_s:.4f} | {r.exposed_comm_s:.4f} | {r.overlap_ratio:.2f} | {speed} |")
    return "\n".join(lines)


def _engine(plan: Any) -> str:
    if plan.engine == "reducer":
        return (f"engine: the framework's reducer (DDP's), buckets {plan.bucket_bytes / MB:g} MiB "
                "(these pieces where it cannot run)")
    return "engine: commsched"


def run_plan(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args)
        profile = load_profile(args, topology)
        if args.split_tied:
            profile = profile.with_tied_split()
        overrides = {k: v for k, v in (("partitions", _sizes(args.partitions_mb, "--partitions-mb")),
                                       ("credits", _sizes(args.credits_mb, "--credits-mb")),
                                       ("fusions", _sizes(args.fusions_mb, "--fusions-mb")),
                                       ("reducer_buckets", () if (args.reducer_mb or "").strip().lower() == "none"
                                        else _sizes(args.reducer_mb, "--reducer-mb"))) if v is not None}
        search = PlanSearch.for_profile(profile, time_limit_s=args.time_limit, min_gain=args.min_gain,
                                         kept_default_order=args.kept_default_order, **overrides)
        compare = [s.strip() for s in args.compare.split(",") if s.strip()]
    except (ValueError, TypeError) as exc:
        print(f"commsched plan: {exc}", file=sys.stderr)
        return 2
    # A bar over the search's stages, on a terminal only (commsched.progress).
    with Progress("plan", len(PLAN_STAGES), transient=True) as bar:
        def progress(stage: str, done: int, candidates: int) -> None:
            bar.update(done, description=f"plan: {stage} ({candidates} candidates scored)")

        result = make_plan(profile, topology, search, progress=progress)
    result.plan.to_json(args.json)
    print(plan_markdown(result, profile, topology, compare))
    print(f"\nwrote {args.json}")
    return 0
