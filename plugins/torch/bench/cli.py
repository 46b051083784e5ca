"""``commsched bench``: compare communication strategies on an emulated cluster.

``core/cli.py`` registers the subcommand with :func:`add_arguments` and calls
:func:`run`; ``python -m commsched.plugins.torch.bench`` does the same alone.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys

from commsched.bench.netns import NetworkSetupError, make_cluster, parse_rate
from commsched.bench.procs import signals_raise
from commsched.plugins.torch.bench.report import build_report, markdown, plot, write_json
from commsched.plugins.torch.bench.runner import RunConfig, Runner, make_work_dir
from commsched.plugins.torch.bench.spec import parse_strategies

DEFAULT_STRATEGIES = "ddp,ddp:4,horovod,fifo,dynamic,static"
#: Workloads offered on the command line ("tiny" exists for tests).
WORKLOAD_CHOICES = ("comm-heavy", "balanced", "compute-heavy", "gpt2", "tiny")
MB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` flags to ``parser``."""
    parser.add_argument("--workload", choices=WORKLOAD_CHOICES, default="balanced",
                        help="model to train (default: balanced)")
    parser.add_argument("--workers", type=int, default=2, help="data-parallel ranks (default 2)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="emulated machines; workers/nodes share each node's unshaped "
                             "loopback (default: one node per worker)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="rate of every node link, each direction, as tc writes it "
                             "(1gbit, 500mbit) or 'none' (default 1gbit)")
    parser.add_argument("--intra-bandwidth", default="none",
                        help="rate shared by all traffic between workers of one node "
                             "(one tbf on the node's loopback), or 'none' (default)")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                        help=f"comma-separated: ddp, ddp:<bucket MB>, horovod, fifo, dynamic, "
                             f"static, allreduce (default {DEFAULT_STRATEGIES})")
    parser.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default 3)")
    parser.add_argument("--json", required=True, metavar="PATH", help="write the report here")
    parser.add_argument("--plot", metavar="PATH", help="PNG of step time per strategy")
    parser.add_argument("--timeline", metavar="DIR",
                        help="Chrome-trace per commsched strategy (rank 0) into DIR")
    parser.add_argument("--network", choices=("netns", "loopback"), default="netns",
                        help="netns: shaped namespaces (needs root; falls back to loopback "
                             "without); loopback: unshaped 127.0.0.1")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per worker per step (default: the workload's)")
    parser.add_argument("--partition-mb", type=float, default=1.0,
                        help="commsched piece size in MiB (default 1)")
    parser.add_argument("--credit-mb", type=float, default=4.0,
                        help="commsched bytes in flight in MiB (default 4)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one phase (one strategy) may take before its workers "
                             "are killed (default 900)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")


def _config(args: argparse.Namespace) -> RunConfig:
    nodes = args.workers if args.nodes is None else args.nodes
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if nodes < 1 or args.workers % nodes:
        raise ValueError(f"--nodes {nodes} must divide --workers {args.workers}")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    for flag, mb in (("--partition-mb", args.partition_mb), ("--credit-mb", args.credit_mb)):
        if not mb > 0:
            raise ValueError(f"{flag} must be positive, got {mb}")
    parse_rate(args.bandwidth)
    parse_rate(args.intra_bandwidth)
    strategies = parse_strategies(args.strategies)
    # Last: it imports torch, slow enough that argument errors should come first.
    from commsched.plugins.torch.bench.workloads import get_workload

    workload = get_workload(args.workload)
    return RunConfig(
        workload=args.workload, workers=args.workers, nodes=nodes,
        bandwidth=None if parse_rate(args.bandwidth) is None else args.bandwidth,
        intra_bandwidth=None if parse_rate(args.intra_bandwidth) is None else args.intra_bandwidth,
        strategies=strategies, steps=args.steps, warmup=args.warmup,
        batch_size=args.batch_size or workload.batch_size,
        partition_bytes=int(args.partition_mb * MB), credit_bytes=int(args.credit_mb * MB),
        network=args.network, timeline_dir=args.timeline, seed=args.seed,
        phase_timeout_s=args.timeout,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; 0 when every strategy ran or was
    skipped, 1 when one failed, 2 on bad arguments or a network that cannot be built."""
    try:
        config = _config(args)
    except ValueError as exc:
        print(f"commsched bench: {exc}", file=sys.stderr)
        return 2
    from commsched.plugins.torch.bench.workloads import get_workload

    workload = get_workload(config.workload)
    cluster = make_cluster(config.network, config.nodes, config.bandwidth,
                           config.intra_bandwidth)
    if cluster.emulation == "loopback":
        print(f"commsched bench: {cluster.note}; step times do not reflect "
              "--bandwidth", file=sys.stderr)
    work_dir = make_work_dir()
    print(f"commsched bench: {config.workload}, {config.workers} workers, "
          f"{cluster.note}; logs in {work_dir}", file=sys.stderr)
    try:
        with signals_raise(), cluster:
            baseline, phases = Runner(config, cluster, work_dir).run_all()
    except NetworkSetupError as exc:
        print(f"commsched bench: cannot build the emulated network: {exc}\n"
              "  (use --network loopback to run unshaped)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"commsched bench: interrupted ({exc or 'SIGINT'}); network torn down, "
              f"logs in {work_dir}", file=sys.stderr)
        return 130
    if baseline.status == "ok":
        from commsched.plugins.torch.bench.workloads import format_layers

        r0 = baseline.ranks[0]
        print(f"{workload.name}: {r0['param_bytes'] / 1e6:.1f} MB of parameters; per layer "
              f"(rank 0 alone):\n{format_layers(r0['layers'])}", file=sys.stderr)
    run_config = {
        "workload": config.workload, "workers": config.workers, "nodes": config.nodes,
        "bandwidth": config.bandwidth, "intra_bandwidth": config.intra_bandwidth,
        "strategies": [s.name for s in config.strategies], "steps": config.steps,
        "warmup": config.warmup, "baseline_steps": config.baseline_steps,
        "batch_size": config.batch_size, "partition_bytes": config.partition_bytes,
        "credit_bytes": config.credit_bytes, "network": config.network, "seed": config.seed,
    }
    report = build_report(run_config, cluster.emulation, cluster.note,
                          {"name": workload.name, "description": workload.description},
                          baseline, phases)
    print(markdown(report))
    write_json(report, args.json)
    if args.plot:
        plot(report, args.plot)
    failed = baseline.status == "failed" or any(p.status == "failed" for p in phases)
    if failed:
        print(f"commsched bench: some phases failed; logs kept in {work_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(work_dir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m commsched.plugins.torch.bench``: the same flags as ``commsched bench``."""
    parser = argparse.ArgumentParser(prog="python -m commsched.plugins.torch.bench",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))
