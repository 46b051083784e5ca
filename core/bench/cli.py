"""``commsched bench``: compare communication strategies on an emulated cluster.

``core/cli.py`` registers the subcommand with :func:`add_arguments` and calls
:func:`run` (``--framework torch``, the default); ``python -m
commsched.plugins.torch.bench`` does the same alone. The framework parts come
from the plugin's ``bench/strategies.py``, ``bench/worker.py`` and
``bench/workloads.py`` (:data:`PLUGIN`), imported only when a run starts.

:func:`run_strategies` is the shared loop of the MLP benchmarks
(``--framework tensorflow|mxnet``): one fresh cluster per strategy, one report.
"""

from __future__ import annotations

import argparse
import os
import importlib
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from commsched.bench.cpu import BUSY_WARNING, CpuWindow
from commsched.bench.netns import NetworkSetupError, make_cluster, parse_rate
from commsched.bench.options import mebibytes, parse_strategy_list
from commsched.bench.procs import signals_raise
from commsched.bench.picture import draw_timeline
from commsched.bench.report import (
    REGIME_TARGET,
    assemble_report,
    build_report,
    markdown,
    median,
    plot,
    reference_baseline,
    result_entry,
    rounds_entry,
    step_fields,
    write_json,
)
from commsched.bench.runner import (
    RunConfig,
    Runner,
    check_interleave,
    check_max_steal,
    make_work_dir,
    round_order,
)
from commsched.bench.spec import parse_strategies
from commsched.progress import Progress

#: The plugin package that supplies the workload benchmark's framework parts.
PLUGIN = "commsched.plugins.torch.bench"

DEFAULT_STRATEGIES = "ddp,ddp:4,horovod,fifo,dynamic,static"
#: Workloads offered on the command line ("tiny" exists for tests).
WORKLOAD_CHOICES = ("comm-heavy", "balanced", "compute-heavy", "gpt2", "tiny")
MB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` flags to ``parser``."""
    parser.add_argument("--workload", default="balanced",
                        help=f"model to train: one of {', '.join(WORKLOAD_CHOICES)} (default balanced), or "
                             "module:function returning (model, make_batch, loss_fn[, batch_size]); see docs/torch.md")
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
                             f"dynamic:<partition>/<credit> (e.g. dynamic:1MiB/4MiB, 'none' for no limit; "
                             f"also static:...), static, auto, planned, hierarchical, slack, allreduce "
                             f"(default {DEFAULT_STRATEGIES})")
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
    parser.add_argument("--partition-mb", type=mebibytes, default=1.0,
                        help="commsched piece size in MiB (default 1)")
    parser.add_argument("--credit-mb", type=mebibytes, default=4.0,
                        help="commsched bytes in flight in MiB (default 4)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one phase (one strategy) may take before its workers "
                             "are killed (default 900)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every strategy this many times, each round in another order (a Williams design), and "
                             "report the "
                             "median of the rounds and each strategy's speedup paired with ddp of the same round "
                             "(default 1; use 3 or more on a shared or noisy machine: docs/bench.md, Rounds)")
    parser.add_argument("--calibrate", action="store_true",
                        help="before the baseline, measure compute and comm at two batch sizes and pick the one "
                             "that puts the workload in its named regime on this machine (two short extra "
                             "phases; without it the report only says which regime was measured)")
    parser.add_argument("--max-steal", type=float, default=None, metavar="SHARE",
                        help="run a strategy's phase again when the hypervisor took more than this share of the "
                             "machine's CPU during its measured steps (its cpu_steal; e.g. 0.05); the run with the "
                             "least steal is kept and the others' steal reported (rerun_steal). Default: never")
    parser.add_argument("--interleave", type=int, default=0, metavar="BLOCKS",
                        help="run every strategy in one phase, in the same worker processes (each on its own copy of "
                             "the model), alternating in BLOCKS blocks of --steps measured steps each (an unmeasured "
                             "lead step before, an unmeasured trail step after, then drained); each block is reported "
                             "as a round, paired like rounds. Seconds apart instead of a phase apart, two strategies "
                             "see the same host (docs/bench.md, Interleaved blocks); --timeout is per strategy. Not "
                             "with --rounds, --max-steal, --timeline or horovod. Default 0: one phase per strategy")
    parser.add_argument("--steal-retries", type=int, default=2,
                        help="with --max-steal: at most this many more runs of one phase (default 2)")


def _config(args: argparse.Namespace) -> RunConfig:
    nodes = args.workers if args.nodes is None else args.nodes
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if nodes < 1 or args.workers % nodes:
        raise ValueError(f"--nodes {nodes} must divide --workers {args.workers}")
    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1 (1: each strategy once), got {rounds}")
    for flag, mb in (("--partition-mb", args.partition_mb), ("--credit-mb", args.credit_mb)):
        if not mb > 0:
            raise ValueError(f"{flag} must be positive, got {mb}")
    max_steal = getattr(args, "max_steal", None)
    check_max_steal(max_steal, "--max-steal")
    steal_retries = getattr(args, "steal_retries", 2)
    if steal_retries < 0:
        raise ValueError(f"--steal-retries must be >= 0 (0: report the steal, never run again), got {steal_retries}")
    parse_rate(args.bandwidth)
    parse_rate(args.intra_bandwidth)
    strategies = parse_strategies(args.strategies)
    interleave = getattr(args, "interleave", 0)
    check_interleave(interleave, rounds, max_steal, args.timeline, strategies)
    calibrate = getattr(args, "calibrate", False)
    if calibrate and args.batch_size is not None:
        raise ValueError(f"--calibrate chooses the batch size itself; drop --batch-size {args.batch_size} "
                         "or --calibrate")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    # Last: it imports the framework, slow enough that argument errors should come first.
    workload = importlib.import_module(f"{PLUGIN}.workloads").get_workload(args.workload)
    if calibrate and REGIME_TARGET.get(workload.regime or "") is None:
        raise ValueError(f"--calibrate needs a workload that names its regime (comm-heavy, balanced, "
                         f"compute-heavy, gpt2); {args.workload!r} names none: pass --batch-size instead")
    return RunConfig(
        workload=args.workload, workers=args.workers, nodes=nodes,
        bandwidth=None if parse_rate(args.bandwidth) is None else args.bandwidth,
        intra_bandwidth=None if parse_rate(args.intra_bandwidth) is None else args.intra_bandwidth,
        strategies=strategies, steps=args.steps, warmup=args.warmup,
        batch_size=args.batch_size or workload.batch_size,
        partition_bytes=int(args.partition_mb * MB), credit_bytes=int(args.credit_mb * MB),
        network=args.network, timeline_dir=args.timeline, seed=args.seed,
        phase_timeout_s=args.timeout, calibrate=calibrate, rounds=rounds,
        max_steal=max_steal, steal_retries=steal_retries, interleave=interleave,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; 0 when every strategy ran or was
    skipped, 1 when one failed, 2 on bad arguments or a network that cannot be built."""
    try:
        config = _config(args)
    except ValueError as exc:
        print(f"commsched bench: {exc}", file=sys.stderr)
        return 2
    workloads = importlib.import_module(f"{PLUGIN}.workloads")
    strategies = importlib.import_module(f"{PLUGIN}.strategies")
    workload = workloads.get_workload(config.workload)
    cluster = make_cluster(config.network, config.nodes, config.bandwidth,
                           config.intra_bandwidth)
    if cluster.emulation == "loopback":
        print(f"commsched bench: {cluster.note}; step times do not reflect "
              "--bandwidth", file=sys.stderr)
    work_dir = make_work_dir()
    print(f"commsched bench: {config.workload}, {config.workers} workers, "
          f"{cluster.note}; logs in {work_dir}", file=sys.stderr)
    calibration: dict[str, Any] = {"expected": workload.regime, "default_batch_size": config.batch_size,
                                   "batch_size": config.batch_size}
    try:
        with signals_raise(), cluster:
            runner = Runner(config, cluster, work_dir, worker_module=f"{PLUGIN}.worker",
                            unavailable=strategies.unavailable_reason)
            if config.calibrate:
                calibration.update(runner.calibrate(REGIME_TARGET[workload.regime]))
                print(f"commsched bench: --calibrate: batch {config.batch_size} per worker "
                      f"(default {calibration['default_batch_size']})", file=sys.stderr)
            baseline, phases = runner.run_all()
    except NetworkSetupError as exc:
        print(f"commsched bench: cannot build the emulated network: {exc}\n"
              "  (use --network loopback to run unshaped)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"commsched bench: interrupted ({exc or 'SIGINT'}); network torn down, "
              f"logs in {work_dir}", file=sys.stderr)
        return 130
    if baseline.status == "ok":
        r0 = baseline.ranks[0]
        print(f"{workload.name}: {r0['param_bytes'] / 1e6:.1f} MB of parameters; per layer "
              f"(rank 0 alone):\n{workloads.format_layers(r0['layers'])}", file=sys.stderr)
    run_config = {
        "workload": config.workload, "workers": config.workers, "nodes": config.nodes,
        "bandwidth": config.bandwidth, "intra_bandwidth": config.intra_bandwidth,
        "strategies": [s.name for s in config.strategies], "steps": config.steps,
        "warmup": config.warmup, "baseline_steps": config.baseline_steps,
        "batch_size": config.batch_size, "partition_bytes": config.partition_bytes,
        "credit_bytes": config.credit_bytes, "network": config.network, "seed": config.seed,
        "extra": {"timeout_s": config.phase_timeout_s, "calibrate": config.calibrate, "rounds": config.rounds,
                  "max_steal": config.max_steal, "steal_retries": config.steal_retries,
                  "interleave": config.interleave},
    }
    report = build_report(run_config, cluster.emulation, cluster.note,
                          {"name": workload.name, "description": workload.description},
                          baseline, [p if config.rounds > 1 or config.interleave else p[0] for p in phases],
                          calibration=calibration)
    print(markdown(report))
    write_json(report, args.json)
    if args.plot:
        plot(report, args.plot)
    draw_timelines(report)
    failed = baseline.status == "failed" or any(p.status == "failed" for rounds in phases for p in rounds)
    if failed:
        print(f"commsched bench: some phases failed; logs kept in {work_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(work_dir, ignore_errors=True)
    return 0


def draw_timelines(report: dict) -> list[str]:
    """Next to every timeline a strategy wrote (``--timeline DIR``), the picture of its last steps (PNG)."""
    drawn = []
    for entry in report["results"]:
        paths = entry.get("timeline") or []
        for path in [paths] if isinstance(paths, str) else paths:
            try:
                drawn.append(draw_timeline(path, os.path.splitext(path)[0] + ".png",
                                           title=f"{entry['strategy']} (measured, {os.path.basename(path)})"))
            except (OSError, ValueError, KeyError) as exc:
                print(f"commsched bench: no picture of {path}: {exc}", file=sys.stderr)
    return drawn


def main(argv: list[str] | None = None) -> int:
    """``python -m commsched.plugins.torch.bench``: the same flags as ``commsched bench``."""
    return standalone_main("python -m commsched.plugins.torch.bench", __doc__.splitlines()[0],
                           add_arguments, run, argv, log_level=logging.WARNING,
                           log_format="%(levelname)s %(name)s: %(message)s")


def standalone_main(prog: str, description: str, add: Callable[[argparse.ArgumentParser], None],
                    run_args: Callable[[argparse.Namespace], int], argv: list[str] | None, *,
                    log_level: int = logging.INFO, log_format: str = "%(message)s") -> int:
    """A benchmark's own ``python -m`` entry point: its flags, logging to stderr, its run."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add(parser)
    logging.basicConfig(level=log_level, format=log_format)
    return run_args(parser.parse_args(argv))


# ---------------------------------------------------------------- MLP benchmarks (TensorFlow, MXNet)
#: ``launch(cluster, strategy, out_dir)`` runs one strategy's job to its end and
#: returns ``None``, or why it failed; worker 0 writes ``out_dir/rank0.json``:
#: ``{"step_times_s": [...], "world": N, "pieces_per_step": P | null}`` or ``{"skipped": why}``.
Launch = Callable[[Any, str, Path], "str | None"]


def run_strategies(args: argparse.Namespace, *, framework: str, allowed: Sequence[str], nodes: int,
                   launch: Launch, workload: dict[str, Any], extra: dict[str, Any]) -> int:
    """Run each of ``args.strategies`` on a fresh emulated cluster of ``nodes``
    machines, then print the table and write the report (docs/bench.md).

    Returns 0 when every strategy ran or was skipped, 1 when one failed, 2 on
    bad arguments or a network that cannot be built, 130 when interrupted
    (Ctrl-C, SIGTERM, SIGHUP: the cluster is torn down first either way).
    """
    chosen, unknown = parse_strategy_list(args.strategies, allowed)
    if unknown:
        print(f"commsched bench: unknown strategies {unknown}; choose from {', '.join(allowed)}", file=sys.stderr)
        return 2
    if not chosen:
        print(f"commsched bench: no strategy given; choose from {', '.join(allowed)}", file=sys.stderr)
        return 2
    try:
        parse_rate(args.bandwidth)
    except ValueError as exc:
        print(f"commsched bench: {exc}", file=sys.stderr)
        return 2
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        print(f"commsched bench: --rounds must be >= 1 (1: each strategy once), got {rounds}", file=sys.stderr)
        return 2
    # One run per strategy and round: (strategy, round, position, result, error, cpu, logs).
    raw: list[tuple[str, int, int, dict | None, str | None, dict, Path]] = []
    note, emulation = "", args.network
    total = len(chosen) * rounds
    try:
        # Ctrl-C / SIGTERM: the cluster's __exit__ kills the workers and deletes namespaces
        with signals_raise(), Progress(f"{framework} bench", total, transient=True) as bar:
            for round_index in range(rounds):
                # One round keeps the order given; more run each round in a row of a Williams design.
                order = chosen if rounds == 1 else [chosen[i] for i in round_order(len(chosen), round_index)]
                for position, strategy in enumerate(order):
                    done = len(raw)
                    label = strategy if rounds == 1 else f"{strategy} (round {round_index + 1}/{rounds})"
                    bar.update(done, description=f"[{done + 1}/{total}] {label}")
                    out = Path(tempfile.mkdtemp(prefix=f"commsched-bench-{framework}-{strategy}-"))
                    with make_cluster(args.network, nodes, args.bandwidth) as cluster:
                        note, emulation = cluster.note, cluster.emulation
                        window = CpuWindow()
                        error = launch(cluster, strategy, out)
                        cpu = window.stop()
                    result = _read_json(out / "rank0.json")
                    raw.append((strategy, round_index, position, result, error, cpu, out))
                    bar.update(done + 1)
                    bar.note(_progress_line(label, result, error, out))
    except NetworkSetupError as exc:
        print(f"commsched bench: cannot build the emulated network: {exc}\n"
              "  (use --network loopback to run unshaped)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"commsched bench: interrupted ({exc or 'SIGINT'}); network torn down", file=sys.stderr)
        return 130
    ok_medians: dict[str, list[float]] = {}
    for s, _, _, r, e, _, _ in raw:
        if r and r.get("step_times_s") and e is None:
            ok_medians.setdefault(s, []).append(median(r["step_times_s"]))
    baseline = reference_baseline(*(median(ok_medians[s]) if s in ok_medians else None for s in ("compute", "comm")))
    results = []
    for strategy in chosen:
        runs = [(rnd, pos, _mlp_entry(s, r, e, cpu, out, args.batch_size, baseline), (r or {}).get("step_times_s"))
                for s, rnd, pos, r, e, cpu, out in raw if s == strategy]
        world = next((r.get("world", 1) for s, _, _, r, _, _, _ in raw if s == strategy and r), 1)
        entry = runs[0][2] if rounds == 1 else rounds_entry(runs, baseline, args.batch_size * world)
        if strategy in ("compute", "comm"):  # they measure the bound: against it they say nothing
            entry.update(efficiency=None, overlap_ratio=None, exposed_comm_s=None, overlap_method=None)
        results.append(entry)
    config = {
        "workload": workload["name"], "workers": args.workers, "nodes": nodes, "bandwidth": args.bandwidth,
        "intra_bandwidth": None, "strategies": chosen, "steps": args.steps, "warmup": args.warmup,
        "baseline_steps": None, "batch_size": args.batch_size,
        "partition_bytes": int(args.partition_mb * MB), "credit_bytes": int(args.credit_mb * MB),
        "network": args.network, "seed": 0, "extra": {**extra, "rounds": rounds},
    }
    report = assemble_report(framework, config, emulation, note, workload, baseline, results)
    write_json(report, args.json)
    print(markdown(report))
    kept = _forget_finished_runs(raw)
    if kept:
        print(f"commsched bench: some phases failed; logs kept in {', '.join(str(d) for d in kept)}", file=sys.stderr)
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


def _forget_finished_runs(raw: list[tuple[str, int, int, dict | None, str | None, dict, Path]]) -> list[Path]:
    """Delete the directory of every phase that ended with a result (its logs are of no further use and
    a run leaves one per strategy and round in the temporary directory); keep, and return, those of the
    phases that failed, which the report and the progress lines name."""
    kept = []
    for _, _, _, result, error, _, out in raw:
        if _failed(result, error):
            kept.append(out)
        else:
            shutil.rmtree(out, ignore_errors=True)
    return kept


def _failed(result: dict | None, error: str | None) -> bool:
    """Whether a phase failed: it did not skip, and it reported an error or wrote no step times."""
    if result and result.get("skipped"):
        return False
    return error is not None or not result or not result.get("step_times_s")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _progress_line(strategy: str, result: dict | None, error: str | None, out: Path) -> str:
    if result and result.get("skipped"):
        return f"{strategy:>18}: skipped ({result['skipped']})"
    if not _failed(result, error):
        return f"{strategy:>18}: {median(result['step_times_s']) * 1000:8.1f} ms/step (median)"
    return f"{strategy:>18}: failed ({(error or 'worker 0 wrote no result').splitlines()[0]}); logs in {out}"


def _mlp_entry(strategy: str, result: dict | None, error: str | None, cpu: dict, out: Path,
               batch_size: int, baseline: dict | None) -> dict[str, Any]:
    if result and result.get("skipped"):
        return result_entry(strategy, "skipped", reason=result["skipped"])
    if _failed(result, error):
        return result_entry(strategy, "failed", reason=(error or f"worker 0 wrote no result ({out})")[-2000:],
                            logs=str(out))
    busy = cpu["cpu_busy"]
    return result_entry(
        strategy, "ok", **step_fields(result["step_times_s"], batch_size * result.get("world", 1), baseline),
        cpu_busy=busy, cpu_steal=cpu.get("cpu_steal"), cpu_warning=busy is not None and busy > BUSY_WARNING,
        pieces_per_step=result.get("pieces_per_step"), stats=result.get("stats"),
    )
