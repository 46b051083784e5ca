"""``commsched simulate``, ``commsched validate`` and ``commsched advise``.

``simulate`` predicts what ``commsched bench`` measures with the same flags (from a
profile of the workload on this machine, cached) or a zoo model on a described
cluster; its JSON is the bench report schema with ``"predicted": true``.
``validate`` runs a grid of ``commsched bench`` configurations and the simulator on
each, and reports the error of each strategy's step time and the rank correlation
(Kendall τ) of the strategies' order. ``advise`` says whether scheduling will help.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

from commsched.bench.picture import draw_timeline
from commsched.bench.report import (BASELINE_KEYS, assemble_report, beats_dependency, dependency_block, markdown,
                                    median, result_entry, write_json)
from commsched.bench.runner import check_max_steal
from commsched.config import SchedulerConfig
from commsched.costmodel.bounds import bound_by_bytes
from commsched.costmodel.collectives import allreduce_s, best_algorithm
from commsched.costmodel.planner import LARGE_GRAD_BYTES, PlanSearch
from commsched.costmodel.profile import Profile
from commsched.costmodel.simulator import SimResult, SimSettings, parse_sim_strategy, simulate
from commsched.costmodel.topology import Topology
from commsched.progress import Progress

__all__ = ["advise", "advise_grid", "kendall_tau", "predicted_report", "run_advise", "run_simulate", "run_validate"]

MB = 1 << 20
DEFAULT_STRATEGIES = "ddp,ddp:4,horovod,fifo,dynamic,static"


# ------------------------------------------------------------------ inputs
def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """What to simulate (a profile, a workload of this machine, a zoo model) and on which network."""
    src = p.add_argument_group("the model of the step (one of)")
    src.add_argument("--workload", help="a commsched bench workload (profiled on this machine, cached), "
                                        "or module:function")
    src.add_argument("--profile", help="a profile JSON (commsched profile / DistributedOptimizer.profile())")
    src.add_argument("--model", help="a zoo model: resnet50, vgg16, bert-large, gpt2-xl, gpt-7b, gpt-70b")
    src.add_argument("--device", default="h100", help="zoo: the device whose peak the model runs at (default h100)")
    src.add_argument("--efficiency", type=float, default=0.4, help="zoo: share of the device peak (default 0.4)")
    src.add_argument("--batch-size", type=int, default=None, help="the per-rank batch size")
    src.add_argument("--seq-len", type=int, default=None, help="zoo decoders: tokens per sample")
    src.add_argument("--tp", type=int, default=1, help="zoo: tensor-parallel ways (each DP rank reduces 1/(tp*pp))")
    src.add_argument("--pp", type=int, default=1, help="zoo: pipeline-parallel stages")
    net = p.add_argument_group("the network (an emulated cluster, a described one, or a topology file)")
    net.add_argument("--workers", type=int, default=None, help="ranks of the emulated cluster (as commsched bench)")
    net.add_argument("--nodes", type=int, default=None, help="nodes of the emulated cluster")
    net.add_argument("--bandwidth", default=None, help="emulated: the shaped link of each node, e.g. 1gbit")
    net.add_argument("--intra-bandwidth", default=None, help="emulated: the link between ranks of a node")
    net.add_argument("--cluster", default=None, help="described: NODESxRANKS, e.g. 16x8")
    net.add_argument("--intra", default="900GB/s", help="described: bandwidth between ranks of a node")
    net.add_argument("--inter", default="100gbit", help="described: one node's link to the network")
    net.add_argument("--rails", type=int, default=1, help="described: NICs per node (rail-aligned rings)")
    net.add_argument("--topology", default=None, help="a topology JSON (commsched probe)")


def source_flags(args: argparse.Namespace) -> list[str]:
    """The model and network flags of ``args`` (those of :func:`add_source_arguments`) that differ from their
    defaults, as a command line names them: what another command (``commsched plan``) needs to read the
    same model on the same network."""
    parser = argparse.ArgumentParser(add_help=False)
    add_source_arguments(parser)
    flags: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of a parser's arguments
        value = getattr(args, action.dest, action.default)
        if action.option_strings and value is not None and value != action.default:
            flags += [action.option_strings[0], shlex.quote(str(value))]
    return flags


def load_topology(args: argparse.Namespace) -> Topology:
    """The topology the arguments name; ``ValueError`` naming the flags when they do not add up."""
    chosen = [flag for flag, value in (("--topology", args.topology), ("--cluster", args.cluster),
                                       ("--bandwidth", args.bandwidth)) if value]
    if len(chosen) != 1:
        raise ValueError("name the network once: --workers N --bandwidth B (emulated), --cluster NxR --intra X "
                         f"--inter Y (described) or --topology T.json; got {chosen or 'none'}")
    if args.topology:
        return Topology.from_json(args.topology)
    if args.cluster:
        return Topology.described(args.cluster, intra=args.intra, inter=args.inter, rails=args.rails)
    return Topology.emulated(args.workers or 2, args.nodes, args.bandwidth, args.intra_bandwidth)


def load_profile(args: argparse.Namespace, topology: Topology) -> Profile:
    """The profile the arguments name (profiling the workload here when no cached one fits)."""
    chosen = [flag for flag, value in (("--profile", args.profile), ("--workload", args.workload),
                                       ("--model", args.model)) if value]
    if len(chosen) != 1:
        raise ValueError(f"name the model of the step once: --profile P, --workload W or --model M; got "
                         f"{chosen or 'none'}")
    if args.profile:
        return Profile.from_json(args.profile)
    if args.model:
        from commsched.costmodel.zoo import zoo_profile

        return zoo_profile(args.model, args.device, batch_size=args.batch_size, seq_len=args.seq_len,
                           efficiency=args.efficiency, tp=args.tp, pp=args.pp)
    try:
        from commsched.plugins.torch.profiler import load_or_profile
    except ImportError as exc:
        raise SystemExit(f"commsched simulate --workload needs the torch plugin to profile the workload ({exc}); "
                         "pass --profile P or --model M, or pip install 'commsched[torch]'") from exc
    meta = topology.meta
    return load_or_profile(args.workload, batch_size=args.batch_size, workers=int(meta.get("workers", 2)),
                           nodes=meta.get("nodes"), bandwidth=meta.get("bandwidth"),
                           intra_bandwidth=meta.get("intra_bandwidth"))


def settings_from(args: argparse.Namespace) -> SimSettings:
    for flag, mb in (("--partition-mb", args.partition_mb), ("--credit-mb", args.credit_mb)):
        if not (mb > 0 and mb * MB >= 1):
            raise ValueError(f"{flag} {mb!r} must be a positive size of at least one byte (in MB), e.g. 1")
    return SimSettings(partition_bytes=int(args.partition_mb * MB), credit_bytes=int(args.credit_mb * MB),
                       steps=args.sim_steps)


# ----------------------------------------------------------------- reports
def dependency_fields(profile: Profile, comm_s: float, contended_s: float) -> dict[str, Any]:
    """The report baseline's dependency fields (``commsched.bench.report.dependency_block``) from a
    profile (commsched.costmodel.bounds): the one all-reduce ``comm_s`` split by bytes, each layer's
    update its ``apply_s`` (scaled down to the optimizer's one ``step()`` where that is faster, as DDP
    runs it)."""
    scale = min(1.0, profile.step_optimizer_s / profile.apply_s) if profile.apply_s > 0 else 0.0
    bound = bound_by_bytes([layer.forward_s for layer in profile.layers], profile.ready_times(),
                           [layer.grad_bytes for layer in profile.layers], backward_s=profile.backward_s,
                           comm_s=comm_s, apply_s=[layer.apply_s * scale for layer in profile.layers])
    return dependency_block(bound if comm_s > 0 else None, [layer.name for layer in profile.layers], contended_s)


def compute_beside_allreduce_s(profile: Profile, comm_s: float) -> float:
    """The step's compute beside one all-reduce of ``comm_s`` started with it (the bench's
    ``compute_under_comm_s``, which the contended bound takes): ``contention`` times slower while the
    all-reduce runs (``comm_contention`` times its own length), at full speed once it ended."""
    compute, kappa = profile.compute_s, profile.contention
    return min(compute * kappa, compute + comm_s * profile.comm_contention * (1.0 - 1.0 / kappa))


def predicted_report(profile: Profile, topology: Topology, results: list[SimResult], settings: SimSettings,
                     strategies: list[str], *, workload: str, batch_size: int | None,
                     timelines: dict[str, str] | None = None) -> dict[str, Any]:
    """The bench report schema, filled from the simulation (``"predicted": true``)."""
    comm = allreduce_s(topology, profile.grad_bytes, settings.algorithm) if topology.world_size > 1 else 0.0
    compute = profile.compute_s
    kappa, beside = profile.contention, comm * profile.comm_contention
    under = compute_beside_allreduce_s(profile, comm)
    contended = max(under, comm)
    baseline = {
        "forward_s": profile.forward_s, "backward_s": profile.backward_s, "optimizer_s": profile.step_optimizer_s,
        "compute_s": compute, "compute_one_worker_s": None, "comm_s": comm, "comm_cpu_busy": None,
        "comm_workers_cpu_busy": None,
        "forward_under_comm_s": profile.forward_s * under / compute if compute > 0 else 0.0,
        "backward_under_comm_s": profile.backward_s * under / compute if compute > 0 else 0.0,
        "compute_under_comm_s": under, "under_comm_coverage": min(1.0, beside / under) if under > 0 else None,
        "comm_under_compute_s": comm * profile.comm_contention, "comm_contention": profile.comm_contention,
        "lower_bound_s": max(compute, comm), "contended_bound_s": contended,
        **dependency_fields(profile, comm, contended),
        "no_overlap_s": compute + comm,
        "ddp_model_s": profile.forward_s + max(profile.backward_s, comm) + profile.step_optimizer_s,
        "stream_allreduces": None, "stream_alone_s": None, "compute_under_stream_s": None, "stream_coverage": None,
    }
    baseline["ceiling_speedup_vs_ddp"] = (max(1.0, baseline["ddp_model_s"] / baseline["lower_bound_s"])
                                          if baseline["lower_bound_s"] else None)
    baseline["contention"] = kappa
    baseline = {key: baseline[key] for key in BASELINE_KEYS}
    samples = (batch_size or profile.batch_size or 1) * topology.world_size
    entries = []
    for r in results:
        entries.append(result_entry(
            r.strategy, "ok", reason=None, measured_steps=len(r.step_times_s), step_time_s=r.step_time_s,
            step_time_p25_s=min(r.step_times_s), step_time_p75_s=max(r.step_times_s),
            step_time_iqr_s=max(r.step_times_s) - min(r.step_times_s), mean_step_time_s=r.step_time_s,
            throughput_samples_s=samples / r.step_time_s, bubble_s=r.exposed_comm_s,
            bubble_method="simulated: time the compute lane waits on the network",
            overlap_ratio=r.overlap_ratio, efficiency=baseline["lower_bound_s"] / r.step_time_s,
            efficiency_contended=baseline["contended_bound_s"] / r.step_time_s,
            efficiency_combined=(None if baseline["combined_bound_s"] is None
                                 or beats_dependency(r.strategy, topology.nodes > 1 and topology.ranks_per_node > 1)
                                 else baseline["combined_bound_s"] / r.step_time_s),
            pieces_per_step=r.pieces_per_step, timeline=(timelines or {}).get(r.strategy),
            stats={"comm_busy_s": r.comm_busy_s, "compute_s": r.compute_s,
                   "handoffs_per_step": r.handoffs_per_step}))
    meta = topology.meta
    config = {"workload": workload, "workers": topology.world_size, "nodes": topology.nodes,
              "bandwidth": meta.get("bandwidth") or meta.get("inter"),
              "intra_bandwidth": meta.get("intra_bandwidth") or meta.get("intra"),
              "strategies": strategies, "steps": settings.steps, "warmup": 1, "baseline_steps": None,
              "batch_size": batch_size or profile.batch_size, "partition_bytes": settings.partition_bytes,
              "credit_bytes": settings.credit_bytes, "network": topology.source, "seed": None,
              "extra": {"topology": topology.to_dict(), "profile_source": profile.source,
                        "contention": profile.contention, "comm_contention": profile.comm_contention,
                        "handoff_s": profile.handoff_s, "per_piece_link_s": profile.per_piece_link_s,
                        "algorithm": settings.algorithm}}
    layers = [{"name": layer.name, "bytes": layer.grad_bytes} for layer in profile.layers]
    work = {"name": workload, "description": profile.source, "param_bytes": profile.grad_bytes,
            "num_params": sum(t.numel for layer in profile.layers for t in layer.tensors), "layers": layers}
    report = assemble_report("torch", config, "simulated", f"commsched simulator on {topology.describe()}",
                             work, baseline, entries, _small_piece_warnings(profile, topology, results, settings))
    report["predicted"] = True
    return report


def _small_piece_warnings(profile: Profile, topology: Topology, results: list[SimResult],
                          settings: SimSettings) -> list[str]:
    """Where the gradients are over 1 GiB and the run's piece size is below the grid :func:`advise_grid`
    weighs for them, one line per ``dynamic`` / ``static`` strategy that cut its pieces at it: each piece
    pays the ring's latency steps, so such a row says more about the piece size than about scheduling
    (a 70B decoder on 16 x 8 ranks at the default 1 MiB: 131,721 pieces, 14x DDP's step)."""
    sizes = advise_grid(profile)[0]
    if settings.partition_bytes >= min(sizes) * MB or topology.world_size < 2:
        return []
    return [f"{r.strategy}: {r.pieces_per_step:,.0f} pieces a step of {settings.partition_bytes / MB:g} MiB on "
            f"{topology.world_size} ranks, each paying the all-reduce's latency steps; for "
            f"{profile.grad_bytes / (1 << 30):.0f} GiB of gradients `commsched advise` weighs "
            f"{min(sizes):g}-{max(sizes):g} MiB pieces (--partition-mb, --credit-mb)"
            # ``dynamic:4MiB/16MiB`` and the like carry their own sizes
            for r in results if r.strategy.split("+")[0] in ("dynamic", "static")]


def _write_timelines(results: list[SimResult], directory: str | None) -> dict[str, str]:
    if not directory:
        return {}
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for r in results:
        path = os.path.join(directory, f"sim-{r.strategy.replace(':', '_')}.json")
        with open(path, "w") as fh:
            fh.write(r.trace_json())
        draw_timeline(r.trace, path[:-5] + ".png", title=f"simulated {r.strategy}: step {r.step_time_s:.3f} s")
        paths[r.strategy] = path
    return paths


# ---------------------------------------------------------------- simulate
def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated (default {DEFAULT_STRATEGIES}; also allreduce, hierarchical)")
    p.add_argument("--partition-mb", type=float, default=1.0, help="commsched piece size, MB (as bench)")
    p.add_argument("--credit-mb", type=float, default=4.0, help="commsched credit, MB (as bench)")
    p.add_argument("--sim-steps", type=int, default=5, help="simulated steps (the first is warm-up)")
    p.add_argument("--json", default=None, help="write the predicted report (bench schema) here")
    p.add_argument("--timelines", default=None, help="write a Chrome trace per strategy into this folder")
    p.add_argument("--plan", default=None,
                   help="the plan strategy 'planned' executes (commsched plan --json); without it 'planned' is "
                        "planned here first (commsched plan's search, MILP limit --plan-time-limit)")
    p.add_argument("--plan-time-limit", type=float, default=5.0, help="seconds for the MILP when planning here")
    p.add_argument("--seed-table", action="store_true",
                   help="print the seed's 16x8 / 100 Gbit/s / 70B comparison with physically correct numbers and "
                        "consistent variants (use --strategies ddp,dynamic,... and --partition-mb/--credit-mb)")


#: The seed's claim for 16 nodes x 8 GPUs, 100 Gbit/s between nodes, a 70B model (step, bubble, overlap).
SEED_CLAIM = {"ddp": (0.185, 0.0425, 0.52), "dynamic": (0.132, 0.0062, 0.914), "planned": (0.1215, 0.0028, 0.968)}
SEED_CONFIGS = (
    ("as claimed: gpt-70b, pure data parallel", dict(model="gpt-70b"), "16x8", "100gbit"),
    ("consistent: gpt-7b, pure data parallel", dict(model="gpt-7b"), "16x8", "100gbit"),
    ("consistent: gpt-70b, tp 8 x pp 2 (DP over 8, one 100 Gbit NIC per GPU)", dict(model="gpt-70b", tp=8, pp=2),
     "8x1", "100gbit"),
)


def _plan_for(strategies: list[str], profile: Profile, topology: Topology, path: str | None = None,
              time_limit_s: float = 5.0) -> dict[str, Any]:
    """The plan each ``planned`` strategy executes, by name: read from ``path``, else searched here
    (``planned+tied``: from the profile with its tied embeddings split, as that run's step has
    them); empty without ``planned``."""
    models = {name: parse_sim_strategy(name) for name in strategies}
    wanted = [name for name, m in models.items() if m.ordering == "planned"]
    if not wanted:
        return {}
    from commsched.plan import Plan

    if path:
        plan = Plan.from_json(path)
        return {name: plan for name in wanted}
    from commsched.costmodel.planner import make_plan

    plans: dict[bool, Any] = {}
    for name in wanted:
        split = models[name].split_tied
        if split not in plans:
            source = profile.with_tied_split() if split else profile
            plans[split] = make_plan(source, topology, time_limit_s=time_limit_s).plan
    return {name: plans[models[name].split_tied] for name in wanted}


def seed_table(strategies: list[str], settings: SimSettings, plan_time_limit_s: float = 5.0) -> str:
    """The seed's 16 x 8 / 100 Gbit/s / 70B comparison, simulated, with what its figures would need."""
    from commsched.costmodel.zoo import zoo_profile

    lines = ["| configuration | strategy | step s | exposed comm s | overlap | speedup vs ddp | seed claimed |",
             "|---|---|---:|---:|---:|---:|---|"]
    for label, model, cluster, inter in SEED_CONFIGS:
        prof = zoo_profile(model["model"], "h100", tp=model.get("tp", 1), pp=model.get("pp", 1))
        topo = Topology.described(cluster, intra="900GB/s", inter=inter)
        plans = _plan_for(strategies, prof, topo, time_limit_s=plan_time_limit_s)
        results = {name: simulate(prof, topo, name, settings, plan=plans.get(name)) for name in strategies}
        ddp = results.get("ddp")
        for name, r in results.items():
            claim = SEED_CLAIM.get(name) if "claimed" in label else None
            claimed = f"{claim[0] * 1e3:.1f} ms, {claim[1] * 1e3:.1f} ms, {claim[2]:.0%}" if claim else ""
            speed = f"{ddp.step_time_s / r.step_time_s:.2f}x" if ddp else "-"
            lines.append(f"| {label} | {name} | {r.step_time_s:.3f} | {r.exposed_comm_s:.3f} | {r.overlap_ratio:.2f} | "
                         f"{speed} | {claimed} |")
    prof = zoo_profile("gpt-70b", "h100")
    topo = Topology.described("16x8", intra="900GB/s", inter="100gbit")
    step, bubble, overlap = SEED_CLAIM["ddp"]
    comm_needed = bubble / (1 - overlap)  # exposed = comm x (1 - overlap)
    bytes_needed = comm_needed / allreduce_s(topo, 1 << 30, "ring") * (1 << 30)
    lines += ["", f"The seed's DDP row (bubble {bubble * 1e3:.1f} ms at {overlap:.0%} overlap) implies about "
              f"{comm_needed * 1e3:.0f} ms of all-reduce per step. On 16 x 8 at 100 Gbit/s a flat ring reduces "
              f"{bytes_needed / 1e9:.2f} GB in that time, while gpt-70b's bf16 gradient is "
              f"{prof.grad_bytes / 1e9:.0f} GB ({prof.grad_bytes / bytes_needed:.0f}x more): the seed's figures need "
              "each data-parallel rank to reduce "
              f"about 1/{prof.grad_bytes / bytes_needed:.0f} of the model (tensor x pipeline shards of that degree), "
              f"or a network {prof.grad_bytes / bytes_needed:.0f}x faster than 100 Gbit/s per node."]
    return "\n".join(lines)


def run_simulate(args: argparse.Namespace) -> int:
    if args.seed_table:
        try:
            strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
            for name in strategies:
                parse_sim_strategy(name)
            print(seed_table(strategies, settings_from(args), args.plan_time_limit))
        except ValueError as exc:
            print(f"commsched simulate: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        for name in strategies:
            parse_sim_strategy(name)
        settings = settings_from(args)
        topology = load_topology(args)
        profile = load_profile(args, topology)
    except ValueError as exc:
        print(f"commsched simulate: {exc}", file=sys.stderr)
        return 2
    try:
        plans = _plan_for(strategies, profile, topology, args.plan, args.plan_time_limit)
    except ValueError as exc:
        print(f"commsched simulate: {exc}", file=sys.stderr)
        return 2
    t0 = time.process_time()
    results = [simulate(profile, topology, name, settings, plan=plans.get(name)) for name in strategies]
    cpu = time.process_time() - t0
    report = predicted_report(profile, topology, results, settings, strategies,
                              workload=args.workload or args.model or os.path.basename(args.profile or "profile"),
                              batch_size=args.batch_size, timelines=_write_timelines(results, args.timelines))
    report["config"]["extra"]["simulator_cpu_s_per_step"] = cpu / (len(strategies) * settings.steps)
    print(markdown(report))
    print(f"simulated {len(strategies)} strategies x {settings.steps} steps in {cpu:.2f} s of CPU "
          f"({report['config']['extra']['simulator_cpu_s_per_step'] * 1e3:.1f} ms per simulated step)")
    if args.json:
        write_json(report, args.json)
    return 0


# ---------------------------------------------------------------- validate
def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's τ-a of two equally long lists (1: same order, -1: reversed); 1.0 for fewer than 2."""
    if len(a) != len(b):
        raise ValueError("kendall_tau needs lists of equal length")
    pairs = list(itertools.combinations(range(len(a)), 2))
    if not pairs:
        return 1.0
    score = 0
    for i, j in pairs:
        x, y = a[i] - a[j], b[i] - b[j]
        score += (x * y > 0) - (x * y < 0)
    return score / len(pairs)


def resolved_pairs(rounds: dict[str, list[float]], measured: dict[str, float],
                   predicted: dict[str, float]) -> dict[str, Any] | None:
    """The pairs of strategies the measurement itself orders, and whether the model orders them so.

    ``rounds``: each strategy's median step per round of one ``commsched bench --rounds`` run (paired:
    round k of every strategy ran in the same stretch of time). A pair is *resolved* when every round
    puts it in the same order, and the medians of the rounds agree with it; the rest the run cannot
    order, and a model that gets them "wrong" only disagrees with noise. A diagnostic beside τ, not a
    replacement for it: with three rounds a pair of equal strategies still looks resolved one time in
    four. None with fewer than two rounds of every strategy."""
    names = [s for s in predicted if s in measured and len(rounds.get(s, ())) >= 2]
    if len(names) < len(predicted):
        return None
    resolved, discordant = [], []
    for a, b in itertools.combinations(names, 2):
        n = min(len(rounds[a]), len(rounds[b]))
        signs = {(x > y) - (x < y) for x, y in zip(rounds[a][:n], rounds[b][:n], strict=True)}
        order = (measured[a] > measured[b]) - (measured[a] < measured[b])
        if signs != {order} or order == 0:
            continue
        resolved.append([a, b])
        guess = (predicted[a] > predicted[b]) - (predicted[a] < predicted[b])
        if guess != order:
            discordant.append([a, b])
    return {"pairs": len(names) * (len(names) - 1) // 2, "resolved": resolved, "discordant": discordant,
            "kendall_tau": (len(resolved) - 2 * len(discordant)) / len(resolved) if resolved else None}


def add_validate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="comm-heavy,balanced,compute-heavy,gpt2")
    p.add_argument("--bandwidths", default="1gbit,500mbit")
    p.add_argument("--topologies", default="2,4x2", help="comma-separated WORKERS or WORKERSxNODES (default 2,4x2)")
    p.add_argument("--strategies", default="ddp,ddp:4,fifo,dynamic")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="bench each configuration's strategies this many times, interleaved, and compare the "
                        "simulator with the median of the rounds (commsched bench --rounds; default 1)")
    p.add_argument("--max-steal", type=float, default=None, metavar="SHARE",
                   help="passed to commsched bench: run a strategy's phase again while the hypervisor took more "
                        "than this share of the CPU (e.g. 0.05; default: never)")
    p.add_argument("--partition-mb", type=float, default=1.0)
    p.add_argument("--credit-mb", type=float, default=4.0)
    p.add_argument("--sim-steps", type=int, default=5)
    p.add_argument("--out-dir", default="out/validate", help="bench and predicted reports of each configuration")
    p.add_argument("--reuse", action="store_true",
                   help="reuse bench reports and probed topologies already in --out-dir")
    p.add_argument("--topology-source", choices=("probe", "emulated"), default="emulated",
                   help="the network the simulator uses: the configured one (default; Topology.emulated: the tbf "
                        "rates the bench shapes, 125 us assumed per ring step), or measured by commsched probe on "
                        "each cluster (its small-message latency fit reads 0.6-1.8 ms per ring step on these 2 "
                        "cores and overcharged every piece: 18.9 %% mean error against 9.7 %% on the 2026-12-02 "
                        "grid, docs/simulator.md)")
    p.add_argument("--other-runs", default="",
                   help="comma-separated --out-dir of earlier runs of the same grid: their bench reports are read "
                        "beside this run's, for how far two measurements of one configuration differ (the floor "
                        "under any model's error) and the errors against the median of all runs")
    p.add_argument("--rescale-compute", action="store_true",
                   help="scale each cached profile's compute to the compute_s the bench measured at its start "
                        "(its baseline); the drift is reported either way (profile_drift). Off by default: on "
                        "the 2026-12-03 grids it made the errors larger (docs/simulator.md)")
    p.add_argument("--json", required=True, help="write the validation summary here")


def _grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    grid = []
    for w in [x.strip() for x in args.workloads.split(",") if x.strip()]:
        for bw in [x.strip() for x in args.bandwidths.split(",") if x.strip()]:
            for topo in [x.strip() for x in args.topologies.split(",") if x.strip()]:
                workers, _, nodes = topo.partition("x")
                if not workers.isdigit() or (nodes and not nodes.isdigit()):
                    raise ValueError(f"--topologies entry {topo!r} must be WORKERS or WORKERSxNODES, e.g. 4x2")
                grid.append({"workload": w, "bandwidth": bw, "workers": int(workers),
                             "nodes": int(nodes) if nodes else None})
    return grid


def _pooled_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """With --other-runs: how far runs of one configuration differ, and the errors against their median."""
    pooled = [r for r in rows if "error_vs_pooled" in r]
    if not pooled:
        return {}
    diffs = [abs(d) for r in pooled for v in r["run_to_run"].values() for d in v]
    errs = [abs(e) for r in pooled for e in r["error_vs_pooled"].values()]
    return {"configurations_with_other_runs": len(pooled),
            "run_to_run_mean_abs": sum(diffs) / len(diffs) if diffs else None,
            "run_to_run_median_abs": median(diffs), "run_to_run_max_abs": max(diffs, default=None),
            "mean_abs_error_vs_pooled": sum(errs) / len(errs) if errs else None,
            "max_abs_error_vs_pooled": max(errs, default=None),
            "min_kendall_tau_vs_pooled": min(r["kendall_tau_vs_pooled"] for r in pooled)}


def run_validate(args: argparse.Namespace) -> int:
    try:
        grid = _grid(args)
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        for name in strategies:
            parse_sim_strategy(name)
        settings = settings_from(args)
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1 (1: each strategy once), got {args.rounds}")
        check_max_steal(args.max_steal, "--max-steal")
        for other_dir in [d.strip() for d in args.other_runs.split(",") if d.strip()]:
            if not os.path.isdir(other_dir):
                raise ValueError(f"--other-runs {other_dir!r} is not a directory; name the --out-dir of an "
                                 "earlier validate run")
    except ValueError as exc:
        print(f"commsched validate: {exc}", file=sys.stderr)
        return 2
    from commsched.plugins.torch.probe import probe  # measuring needs torch
    from commsched.plugins.torch.profiler import load_or_profile

    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    # One bar over the configurations (a terminal only; commsched.progress). The bench of each runs in a
    # child whose output goes to a log beside its report, so its own bars do not fight this one.
    with Progress("validate", len(grid)) as bar:
        for i, cfg in enumerate(grid, 1):
            tag = f"{cfg['workload']}-{cfg['bandwidth']}-{cfg['workers']}x{cfg['nodes'] or cfg['workers']}"
            head = f"[{i}/{len(grid)}] {tag}"

            def stage(what: str, head: str = head) -> None:
                bar.update(description=f"{head}: {what}")

            row = _validate_one(args, cfg, tag, strategies, settings, probe, load_or_profile, stage)
            rows.append(row)
            bar.update(i)
            if row["status"] == "ok":
                errors = ", ".join(f"{s} {e:+.1%}" for s, e in row["error"].items())
                drift = row["profile_drift"]
                drift = "" if drift is None else f"; bench compute {drift:+.1%} against the profile"
                pairs = row["resolved_pairs"]
                pairs = "" if pairs is None else (f" ({len(pairs['resolved'])} of {pairs['pairs']} pairs resolved by "
                                                  f"every round, {len(pairs['discordant'])} of them misordered)")
                bar.note(f"{head}: errors {errors}; tau {row['kendall_tau']:.2f}{pairs}{drift}")
            else:
                bar.note(f"{head}: {row['status']} (exit {row['returncode']}; log {row['log']})")
    ok = [r for r in rows if r["status"] == "ok"]
    errs = [abs(e) for r in ok for e in r["error"].values()]
    summary = {"configurations": len(rows), "ok": len(ok), "points": len(errs),
               "mean_abs_error": sum(errs) / len(errs) if errs else None, "max_abs_error": max(errs, default=None),
               "min_kendall_tau": min((r["kendall_tau"] for r in ok), default=None),
               # the measurement's own spread beside the errors: p75 - p25 of a strategy's steps / its median
               "median_measured_iqr_relative": median(
                   [v for r in ok for v in r["measured_iqr_relative"].values() if v is not None]),
               "points_predicted_within_measured_iqr": sum(v for r in ok
                                                           for v in r["predicted_within_measured_iqr"].values()),
               # the pairs every round of the bench ordered the same way, and those the model orders otherwise
               "resolved_pairs": sum(len(r["resolved_pairs"]["resolved"]) for r in ok if r.get("resolved_pairs")),
               "resolved_pairs_discordant": sum(len(r["resolved_pairs"]["discordant"])
                                                for r in ok if r.get("resolved_pairs")),
               "targets": {"mean_abs_error": 0.05, "max_abs_error": 0.10, "kendall_tau": 0.8},
               **_pooled_summary(ok),
               "topology_source": args.topology_source}
    with open(args.json, "w") as fh:
        json.dump({"summary": summary, "configurations": rows}, fh, indent=1)
    print(json.dumps(summary, indent=1))
    return 0 if len(ok) == len(rows) else 1


def _validate_one(args: argparse.Namespace, cfg: dict[str, Any], tag: str, strategies: list[str],
                  settings: SimSettings, probe: Any, load_or_profile: Any, stage: Any) -> dict[str, Any]:
    """Bench (or reuse), probe (or reuse), profile and simulate one configuration of the grid."""
    bench_json = os.path.join(args.out_dir, f"bench-{tag}.json")
    bench_log = os.path.join(args.out_dir, f"bench-{tag}.log")
    if not (args.reuse and os.path.exists(bench_json)):
        stage("bench")
        cmd = [sys.executable, "-m", "commsched", "bench", "--workload", cfg["workload"],
               "--workers", str(cfg["workers"]), "--bandwidth", cfg["bandwidth"],
               "--strategies", ",".join(strategies), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rounds", str(getattr(args, "rounds", 1)),
               "--partition-mb", str(args.partition_mb), "--credit-mb", str(args.credit_mb),
               "--json", bench_json]
        if cfg["nodes"]:
            cmd += ["--nodes", str(cfg["nodes"])]
        if getattr(args, "max_steal", None) is not None:
            cmd += ["--max-steal", str(args.max_steal)]
        with open(bench_log, "w") as log_file:
            done = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=3600)
        if done.returncode != 0 or not os.path.exists(bench_json):
            return {**cfg, "status": "bench failed", "returncode": done.returncode, "log": bench_log}
    with open(bench_json) as fh:
        report = json.load(fh)
    results = [r for r in report["results"] if r["status"] == "ok"]
    bench_compute = (report.get("baseline") or {}).get("compute_s")
    measured = {r["strategy"]: r["step_time_s"] for r in results}
    rounds = {r["strategy"]: [x["step_time_s"] for x in r.get("rounds") or [] if x.get("status") == "ok"]
              for r in results}
    others = []  # the same configuration measured by earlier runs (--other-runs)
    for other_dir in [d.strip() for d in args.other_runs.split(",") if d.strip()]:
        other_json = os.path.join(other_dir, f"bench-{tag}.json")
        if os.path.exists(other_json):
            with open(other_json) as fh:
                others.append({r["strategy"]: r["step_time_s"] for r in json.load(fh)["results"]
                               if r["status"] == "ok"})
    # the measured spread of each strategy's steps (p25, p75): how far the measurement itself moves
    spread = {r["strategy"]: (r.get("step_time_p25_s"), r.get("step_time_p75_s")) for r in results}
    topology = Topology.emulated(cfg["workers"], cfg["nodes"], cfg["bandwidth"])
    if args.topology_source == "probe":
        topo_json = os.path.join(args.out_dir, f"topo-{cfg['bandwidth']}-{cfg['workers']}x"
                                               f"{cfg['nodes'] or cfg['workers']}.json")
        if args.reuse and os.path.exists(topo_json):
            topology = Topology.from_json(topo_json)
        else:
            stage("probe")
            topology = probe(cfg["workers"], cfg["nodes"], cfg["bandwidth"])
            topology.to_json(topo_json)
    stage("profile")
    profile = load_or_profile(cfg["workload"], workers=cfg["workers"], nodes=cfg["nodes"],
                              bandwidth=cfg["bandwidth"])
    # the machine's speed when the bench ran against when the profile was measured: the same
    # baseline (compute alone, all ranks at once), then and now
    drift = profile.drift(bench_compute)
    rescaled = bool(getattr(args, "rescale_compute", False)) and drift is not None
    if rescaled:
        profile = profile.scaled(compute=1.0 + drift)
    stage("simulate")
    names = [s for s in strategies if s in measured]
    predicted = {s: simulate(profile, topology, s, settings).step_time_s for s in names}
    errors = {s: (predicted[s] - measured[s]) / measured[s] for s in names}
    within = {s: spread[s][0] is not None and spread[s][1] is not None
              and spread[s][0] <= predicted[s] <= spread[s][1] for s in names}
    iqr = {s: (spread[s][1] - spread[s][0]) / measured[s] if None not in spread[s] else None for s in names}
    row_extra: dict[str, Any] = {}
    if others:
        runs = {s: [measured[s]] + [o[s] for o in others if s in o] for s in names}
        pooled = {s: median(v) for s, v in runs.items()}
        row_extra = {
            "other_runs_s": {s: v[1:] for s, v in runs.items()},
            "run_to_run": {s: [(x - measured[s]) / measured[s] for x in v[1:]] for s, v in runs.items()},
            "pooled_measured_s": pooled,
            "error_vs_pooled": {s: (predicted[s] - pooled[s]) / pooled[s] for s in names},
            "kendall_tau_vs_pooled": kendall_tau([pooled[s] for s in names], [predicted[s] for s in names]),
        }
    return {**cfg, "status": "ok", "topology": topology.describe(), "measured_s": measured, **row_extra,
            "predicted_s": predicted, "error": errors, "measured_iqr_relative": iqr,
            "predicted_within_measured_iqr": within, "profile_comm_contention": profile.comm_contention,
            "profile_drift": drift, "compute_rescaled": rescaled,
            "profile_contention": profile.contention,
            "kendall_tau": kendall_tau([measured[s] for s in names], [predicted[s] for s in names]),
            "resolved_pairs": resolved_pairs(rounds, measured, predicted)}


# ------------------------------------------------------------------ advise
#: the fusion thresholds of the synchronous candidates :func:`advise` weighs: 1 MiB (``ddp:1``'s bucket,
#: ``commsched.tuner.DDP_SMALL_BUCKET_BYTES``), 4 MiB and DDP's own 25 MiB bucket
#: (``commsched.tuner.DDP_BUCKET_BYTES``): plain fifo on the synchronous path, DDP's shape
SYNC_FUSION_MB = (1.0, 4.0, 25.0)
#: the piece sizes and credits (MiB) of :func:`advise`'s ``dynamic`` candidates, where the gradients are
#: 1 GiB or less (:func:`advise_grid`)
ADVISE_PARTITION_MB = (0.5, 1, 2, 4, 16)
ADVISE_CREDIT_MB = (2, 4, 8, 32)


def advise_grid(profile: Profile) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The piece sizes and credits (MiB) :func:`advise` weighs for ``profile``: :data:`ADVISE_PARTITION_MB` x
    :data:`ADVISE_CREDIT_MB`, or, for gradients over 1 GiB, the planner's grid for such models
    (:meth:`PlanSearch.for_profile`: 16-256 MiB pieces under 64-1024 MiB of credit). There the small grid
    missed what scheduling does: on a 7B decoder over 4 x 8 ranks (100 Gbit/s between nodes) its best,
    2.63 s a step, was 0.98x DDP, where 128 MiB pieces under 512 MiB of credit simulate 2.31 s (1.12x):
    every piece pays the ring's 2(n - 1) latencies. It was also slow: each of its candidates simulated
    ~130,000 pieces a step of a 70B decoder (3.5 min in all)."""
    if profile.grad_bytes > LARGE_GRAD_BYTES:
        search = PlanSearch.for_profile(profile)
        return tuple(p / MB for p in search.partitions), tuple(c / MB for c in search.credits)
    return ADVISE_PARTITION_MB, ADVISE_CREDIT_MB


def two_level_plan(profile: Profile, topology: Topology) -> dict[str, Any] | None:
    """The planner's greedy plan on a two-level topology (nodes x ranks per node, both > 1): its greedy stage
    (:func:`~commsched.costmodel.planner.greedy_grid`: earliest due date over the planner's piece sizes x
    credits for this model, :meth:`PlanSearch.for_profile`) with no fusion and each piece on the faster of
    the flat ring and the two-level algorithm (rule ``"best"``), chosen by the planner's tie rule. What only a
    plan runs at runtime: the two-level algorithm needs the plan's subgroups. None on one node or one rank per
    node (the algorithm is the flat ring's there). The planner itself (``commsched plan``) searches further
    (the other algorithm rules, fusion, per-tensor sizes, the MILP's order): its plan is predicted no slower
    than this one, up to its own tie tolerance."""
    from commsched.costmodel.planner import fewest_pieces_of_ties, greedy_grid

    if topology.nodes <= 1 or topology.ranks_per_node <= 1:
        return None
    search = PlanSearch.for_profile(profile, fusions=(0,))
    _, knobs, plan, result = fewest_pieces_of_ties(greedy_grid(profile, topology, search, ("best",)),
                                                   search.tie_tolerance)
    return {"step_s": result.step_time_s, "partition_bytes": knobs["partition_bytes"],
            "credit_bytes": knobs["credit_bytes"], "pieces_per_step": result.pieces_per_step,
            "two_level_pieces": sum(p.algorithm != "ring" for p in plan.pieces), "pieces": len(plan.pieces),
            "exposed_comm_s": result.exposed_comm_s}


def advise(profile: Profile, topology: Topology, *, partition_mb: tuple[float, ...] | None = None,
           credit_mb: tuple[float, ...] | None = None, fusion_bytes: int | None = None,
           default: dict[str, Any] | None = None, margin: float | None = None,
           sync_fusion_mb: tuple[float, ...] = SYNC_FUSION_MB, weigh_plan: bool = True) -> dict[str, Any]:
    """Whether scheduling helps this model on this network, by how much, with which settings, and why.
    ``fusion_bytes``: the runtime's fusion of small gradients (default the runtime's, 256 KiB).

    The candidates: plain ``fifo``, ``dynamic`` over ``partition_mb`` x ``credit_mb`` (both with
    ``fusion_bytes``; default :func:`advise_grid`, which grows with the model), and DDP's shape
    inside commsched, fifo on the synchronous path with each of
    ``sync_fusion_mb`` as the fusion threshold (simulated strategy ``sync``). The synchronous ones
    carry ``"cross_iteration": False`` and their ``"fusion_bytes"`` in ``settings``; the others
    run with ``fusion_bytes`` and the cross-iteration path. Where communication is already hidden,
    DDP's shape is commsched's best prediction (no per-piece hops on the training thread, no forward
    waits) and the advice says so: scheduling brings nothing there, and the way to lose nothing is
    to run as DDP does.

    ``default``: what runs without advice (``ordering``, ``partition_bytes``, ``credit_bytes``; None:
    ``SchedulerConfig()``'s). The advice departs from it only for a candidate the simulator puts more
    than ``margin`` ahead (default ``PlanSearch.min_gain``, 5 %: the model's error on this machine, the
    planner's own rule): a smaller predicted gain is a guess, and where the model cannot tell settings
    apart what it misses decides. Measured on comm-heavy (2 workers, 1 Gbit/s): the model put 4 MiB
    pieces under a 4 MiB credit 2.1 % ahead of 1 MiB pieces under 4 MiB, and they ran 5-10 % behind in
    three runs (one piece in flight: every piece waits for both ranks' issue, and the small ones run
    alone). ``best_candidate`` is the model's own best either way.

    On a two-level network (``weigh_plan``, the default) it also weighs the planner's greedy plan
    (:func:`two_level_plan`: only a plan runs the two-level algorithm), under ``planned``, recommended where it
    is more than ``margin`` ahead of ``settings``; ``settings`` stays the best runtime setting either way.
    ``weigh_plan=False``: a caller that makes the planner's own plan beside the advice (``auto``'s starts)."""
    fusion = SimSettings().fusion_bytes if fusion_bytes is None else int(fusion_bytes)
    margin = PlanSearch.min_gain if margin is None else float(margin)
    grid_partitions, grid_credits = advise_grid(profile)
    partition_mb = grid_partitions if partition_mb is None else partition_mb
    credit_mb = grid_credits if credit_mb is None else credit_mb
    ddp = min((simulate(profile, topology, name) for name in ("ddp", "ddp:4", "ddp:1")),
              key=lambda r: r.step_time_s)
    plain = SimSettings(fusion_bytes=fusion)
    candidates = [(simulate(profile, topology, "fifo", plain), {"ordering": "fifo"}, plain)]
    for p_mb, c_mb in itertools.product(partition_mb, credit_mb):
        if c_mb < p_mb:
            continue
        s = SimSettings(partition_bytes=int(p_mb * MB), credit_bytes=int(c_mb * MB), fusion_bytes=fusion)
        chosen = {"ordering": "dynamic", "partition_bytes": s.partition_bytes, "credit_bytes": s.credit_bytes}
        candidates.append((simulate(profile, topology, "dynamic", s), chosen, s))
    for f_mb in sync_fusion_mb:
        chosen, s = _sync_candidate(int(f_mb * MB))
        candidates.append((simulate(profile, topology, "sync", s), chosen, s))
    best, settings, best_sim = min(candidates, key=lambda c: c[0].step_time_s)
    usual = _default_candidate(profile, topology, default, fusion, candidates)
    best_candidate = {"settings": settings, "step_s": best.step_time_s}
    gain = 1 - best.step_time_s / usual[0].step_time_s if usual[0].step_time_s > 0 else 0.0
    kept = gain <= margin
    if kept:
        best, settings, best_sim = usual
    speedup = ddp.step_time_s / best.step_time_s
    comm = allreduce_s(topology, profile.grad_bytes, "ring") if topology.world_size > 1 else 0.0
    algo, algo_s = best_algorithm(topology, profile.grad_bytes) if topology.world_size > 1 else ("ring", 0.0)
    bound = max(profile.compute_s, comm)
    dependency = dependency_fields(profile, comm, max(compute_beside_allreduce_s(profile, comm), comm))
    reasons = []
    if comm <= profile.backward_s:
        reasons.append(f"communication ({comm:.3g} s) fits inside backward ({profile.backward_s:.3g} s): DDP "
                       "already hides it, scheduling can only remove the last bucket's tail")
    else:
        reasons.append(f"communication ({comm:.3g} s) outlasts backward ({profile.backward_s:.3g} s): overlapping "
                       "it with the next forward is where the time is")
    if comm > profile.compute_s:
        reasons.append(f"communication-bound: no schedule beats the all-reduce itself ({comm:.3g} s > compute "
                       f"{profile.compute_s:.3g} s); only fewer bytes or a faster algorithm help")
    first = profile.layers[0].grad_bytes / max(1, profile.grad_bytes)
    split = None
    already = profile.meta.get("tied_split")
    if already:
        reasons.append(f"{', '.join(already)} is split already (split_tied_embeddings=True): this profile's "
                       "readiness is the split's")
    elif profile.tied:
        kind = "sync" if settings.get("cross_iteration") is False else settings["ordering"]
        split = simulate(profile, topology, f"{kind}+tied", best_sim)
        reasons.append(f"{', '.join(profile.tied)} is a tied embedding: with PyTorch's DistributedOptimizer("
                       f"split_tied_embeddings=True) the simulated step is {split.step_time_s:.3g} s "
                       f"({ddp.step_time_s / split.step_time_s:.2f}x {ddp.strategy}; the recommended settings, "
                       "the lookup's rows not modelled; docs/torch.md, Tied embeddings)")
    elif first > 0.2:
        reasons.append(f"the first layer is needed first, ready last and large ({first:.0%} of the gradient): its "
                       "reduction cannot overlap with this step's backward; if it is an embedding tied to the output "
                       "layer, PyTorch's DistributedOptimizer(split_tied_embeddings=True) reduces the output layer's "
                       "part during backward and the lookup's part as rows (docs/torch.md)")
    dep_s = dependency["dependency_bound_s"]
    if dep_s is not None and dep_s > bound * 1.03 and dependency["dependency_layer"] is not None:
        layer = dependency["dependency_layer"]
        reasons.append(f"no schedule of whole gradients beats {dep_s:.3g} s ({dep_s - bound:.3g} s above max(compute, "
                       f"comm)): the next forward needs every layer up to {layer} reduced before it reaches {layer}, "
                       f"and none of their gradients is ready before {layer}'s (docs/bench.md, The dependency bound)")
    if algo != "ring" and algo_s < comm * 0.95:
        reasons.append(f"the {algo} algorithm would cut the all-reduce of the whole gradient from {comm:.3g} s to "
                       f"{algo_s:.3g} s (the topology planner chooses it per piece)")
    try:  # None on a flat network; not weighed for a caller that makes the planner's own plan (auto's starts)
        planned = two_level_plan(profile, topology) if weigh_plan else None
    except ImportError as exc:  # the planner's module missing: the runtime settings' advice stands alone
        planned = None
        reasons.append(f"no two-level plan weighed ({exc})")
    if planned is not None:
        ahead = 1 - planned["step_s"] / best.step_time_s if best.step_time_s > 0 else 0.0
        planned.update(speedup_vs_ddp=ddp.step_time_s / planned["step_s"], ahead_of_settings=ahead,
                       recommended=ahead > margin)
        what = (f"the topology planner's earliest-due-date plan ({_size_mb(planned['partition_bytes'])} pieces, "
                f"{planned['two_level_pieces']} of its {planned['pieces']} on the two-level algorithm, credit "
                f"{_size_mb(planned['credit_bytes'])}) simulates {planned['step_s']:.4g} s "
                f"({planned['speedup_vs_ddp']:.2f}x {ddp.strategy}")
        if planned["recommended"]:
            reasons.append(f"{what}, {ahead:.0%} ahead of the settings above; only a plan runs the two-level "
                           "algorithm): make it with `commsched plan` (same model and network flags, --json "
                           "plan.json; it searches further) and train with SchedulerConfig(ordering=\"planned\", "
                           "plan=\"plan.json\")")
        else:
            reasons.append(f"{what}): " + (f"{-ahead:.0%} behind the settings above" if ahead < 0 else
                                            f"not more than the model's error ({margin:.0%}) ahead of the settings "
                                            "above"))
    if kept and best_candidate["settings"] != settings:
        reasons.append(f"the model's best, {_describe(best_candidate['settings'], fusion)} "
                       f"({best_candidate['step_s']:.4g} s), is {gain:.1%} ahead of the default "
                       f"{_describe(settings, fusion)}: inside the model's error ({margin:.0%}), so the default stays")
    if settings.get("cross_iteration") is False:
        reasons.append(f"commsched's best here is DDP's own shape, {_describe(settings, fusion)} "
                       f"({best.step_time_s:.4g} s against {ddp.strategy}'s {ddp.step_time_s:.4g} s): a few large "
                       "collectives and one wait in step(), nothing to schedule; SchedulerConfig(ordering=\"auto\") "
                       "measures it among its start points")
    helps = speedup >= 1.03 or (planned is not None and planned["recommended"]
                                and planned["speedup_vs_ddp"] >= 1.03)
    return {"helps": helps, "expected_speedup_vs_ddp": speedup, "best_ddp": ddp.strategy, "planned": planned,
            "best_ddp_step_s": ddp.step_time_s, "commsched_step_s": best.step_time_s, "settings": settings,
            "lower_bound_s": bound, "efficiency": bound / best.step_time_s, "reasons": reasons,
            "dependency_bound_s": dep_s,
            "split_tied_step_s": None if split is None else split.step_time_s,
            "split_tied_speedup_vs_ddp": None if split is None else ddp.step_time_s / split.step_time_s,
            "default": {"settings": usual[1], "step_s": usual[0].step_time_s}, "best_candidate": best_candidate,
            "margin": margin, "kept_default": kept}


def _default_candidate(profile: Profile, topology: Topology, default: dict[str, Any] | None, fusion: int,
                       simulated: list[tuple[SimResult, dict[str, Any], SimSettings]]
                       ) -> tuple[SimResult, dict[str, Any], SimSettings]:
    """The settings that run without advice (``SchedulerConfig()``'s where ``default`` is None), simulated:
    taken from ``simulated`` (the grid's candidates) when it holds them."""
    if default is None:
        config = SchedulerConfig()
        default = {"ordering": config.ordering, "partition_bytes": config.partition_bytes,
                   "credit_bytes": config.credit_bytes}
    ordering = default.get("ordering", "dynamic")
    if ordering not in ("fifo", "dynamic", "static"):  # auto, planned: the runtime setting they start from
        ordering = "dynamic"
    kind = ordering
    if ordering == "fifo" and default.get("cross_iteration") is False:  # the synchronous path: DDP's shape
        kind, (chosen, s) = "sync", _sync_candidate(int(default.get("fusion_bytes", fusion)))
    elif ordering == "fifo":
        chosen, s = {"ordering": "fifo"}, SimSettings(fusion_bytes=fusion)
    else:
        s = SimSettings(partition_bytes=int(default["partition_bytes"]), credit_bytes=int(default["credit_bytes"]),
                        fusion_bytes=fusion)
        chosen = {"ordering": ordering, "partition_bytes": s.partition_bytes, "credit_bytes": s.credit_bytes}
    found = next((c for c in simulated if c[1] == chosen), None)
    return found if found is not None else (simulate(profile, topology, kind, s), chosen, s)


def _size_mb(nbytes: int) -> str:
    return f"{nbytes / MB:g} MiB"


def _sync_candidate(fusion_bytes: int) -> tuple[dict[str, Any], SimSettings]:
    """DDP's shape with ``fusion_bytes`` of fusion, as an advice's settings and the simulator's (strategy ``sync``)."""
    return ({"ordering": "fifo", "cross_iteration": False, "fusion_bytes": fusion_bytes},
            SimSettings(fusion_bytes=fusion_bytes))


def _describe(settings: dict[str, Any], fusion: int) -> str:
    """``settings`` (an advice's) as the tuner names settings."""
    from commsched.tuner import UNLIMITED_BYTES, Settings

    return Settings(settings["ordering"], settings.get("partition_bytes", UNLIMITED_BYTES),
                    settings.get("credit_bytes", UNLIMITED_BYTES), settings.get("fusion_bytes", fusion),
                    cross_iteration=settings.get("cross_iteration", True)).describe()


def add_advise_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--json", default=None, help="write the advice as JSON here")


def run_advise(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args)
        profile = load_profile(args, topology)
    except ValueError as exc:
        print(f"commsched advise: {exc}", file=sys.stderr)
        return 2
    out = advise(profile, topology)
    verdict = "will help" if out["helps"] else "will not help"
    runtime = (f"{out['expected_speedup_vs_ddp']:.2f}x ({out['best_ddp_step_s']:.4g} s -> "
               f"{out['commsched_step_s']:.4g} s per step; bound {out['lower_bound_s']:.4g} s)")
    planned = out.get("planned") or {}
    if planned.get("recommended"):
        out["plan_command"] = " ".join(["commsched", "plan", *source_flags(args), "--json", "plan.json"])
        print(f"scheduling {verdict} here: expected speedup over the best DDP ({out['best_ddp']}) "
              f"{planned['speedup_vs_ddp']:.2f}x with the topology planner's plan ({out['best_ddp_step_s']:.4g} s -> "
              f"{planned['step_s']:.4g} s per step); {runtime} with runtime settings alone")
        print(f"recommended: {out['plan_command']}, then SchedulerConfig(ordering=\"planned\", plan=\"plan.json\"); "
              f"without a plan: {out['settings']}")
    else:
        print(f"scheduling {verdict} here: expected speedup over the best DDP ({out['best_ddp']}) {runtime}")
        print(f"recommended settings: {out['settings']}")
    for reason in out["reasons"]:
        print(f"- {reason}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0
