"""One report for every framework: metrics, a markdown table, JSON and a plot.

``commsched bench --framework {torch,tensorflow,mxnet}`` all write this schema
(:data:`SCHEMA`; every result entry has exactly :data:`RESULT_KEYS`, the
``baseline`` block :data:`BASELINE_KEYS`, the document :data:`REPORT_KEYS`) and
print the same table (:func:`markdown`), so reports of different frameworks,
and measured and predicted reports, compare key by key. docs/bench.md has the
schema. Fields a framework's benchmark cannot measure are ``null``.

Definitions (all times are medians over the measured steps, in seconds):

- ``compute_s``: forward + backward + optimizer step without communication,
  every worker computing at once (as in a real step, sharing the CPUs);
- ``comm_s``: one all-reduce of all gradient bytes on the same network;
- ``lower_bound_s = max(compute_s, comm_s)``: no schedule can beat it;
- ``overlap_ratio = (compute_s + comm_s - step_time_s) / comm_s``: the share
  of communication hidden behind compute (1 = all, 0 = none, < 0 slower than
  not overlapping at all);
- ``efficiency = lower_bound_s / step_time_s``;
- ``ddp_model_s = forward_s + max(backward_s, comm_s) + optimizer_s``: DDP
  overlaps communication with backward only, so it pays about that;
- ``ceiling_speedup_vs_ddp = ddp_model_s / lower_bound_s``: what perfect
  scheduling could gain over DDP (torch only). When communication outlasts backward this is
  ``(forward + comm) / max(compute, comm)`` (plus the optimizer step); when
  backward hides it, 1 -- nothing to gain (the plain formula would give < 1);
- ``speedup_vs_baseline = baseline step time / step time``, where the baseline
  is the framework's stock strategy named by ``baseline_strategy`` (``ddp``,
  ``mwms``, ``dist_sync``).
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from typing import Any

from commsched.bench.cpu import BUSY_WARNING

SCHEMA = "commsched-bench/2"

#: The stock strategy each framework's speedups are relative to.
BASELINE_STRATEGY = {"torch": "ddp", "tensorflow": "mwms", "mxnet": "dist_sync"}

#: Keys of the whole document.
REPORT_KEYS = ("schema", "framework", "predicted", "baseline_strategy", "config", "emulation",
               "emulation_note", "host", "workload", "baseline", "results", "warnings")
#: Keys of ``config``.
CONFIG_KEYS = ("workload", "workers", "nodes", "bandwidth", "intra_bandwidth", "strategies", "steps",
               "warmup", "baseline_steps", "batch_size", "partition_bytes", "credit_bytes", "network",
               "seed", "extra")
#: Keys of ``workload``.
WORKLOAD_KEYS = ("name", "description", "param_bytes", "num_params", "layers")
#: Keys of ``baseline`` (the reference measurements), when it is not ``null``.
BASELINE_KEYS = ("forward_s", "backward_s", "optimizer_s", "compute_s", "compute_one_worker_s", "comm_s",
                 "comm_cpu_busy", "comm_workers_cpu_busy", "forward_under_comm_s", "backward_under_comm_s",
                 "compute_under_comm_s", "under_comm_coverage", "lower_bound_s", "no_overlap_s",
                 "ddp_model_s", "ceiling_speedup_vs_ddp")
#: Keys of every ``results[]`` entry, whatever its status.
RESULT_KEYS = ("strategy", "status", "reason", "measured_steps", "step_time_s", "step_time_p25_s",
               "step_time_p75_s", "step_time_iqr_s", "mean_step_time_s", "step_time_per_rank_s",
               "throughput_samples_s", "speedup_vs_baseline", "bubble_s", "bubble_method", "forward_s",
               "backward_s", "step_call_s", "overlap_ratio", "efficiency", "cpu_busy", "workers_cpu_busy",
               "cpu_warning", "params_consistent", "pieces_per_step", "timeline", "stats", "logs")


def median(values: Sequence[float]) -> float | None:
    """Median, ``None`` for no values."""
    return quantile(values, 0.5)


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile ``q`` in [0, 1]; ``None`` for no values."""
    s = sorted(v for v in values if v is not None and not math.isnan(v))
    if not s:
        return None
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _max_over_ranks(ranks: list[dict], key: str) -> float | None:
    """The slowest rank's median of ``key``: in a synchronous step it sets the pace."""
    meds = [median(r[key]) for r in ranks if r.get(key)]
    meds = [m for m in meds if m is not None]
    return max(meds) if meds else None


def cpu_use(ranks: list[dict], key: str) -> dict[str, float | None]:
    """Machine-wide busy fraction (rank 0's reading) and our workers' share of it.

    ``workers_busy`` = CPU seconds of all ranks / (wall seconds x CPUs): the
    part of ``cpu_busy`` that is this benchmark; the rest is other load.
    """
    windows = [r[key] for r in ranks if r.get(key)]
    if not windows:
        return {"cpu_busy": None, "workers_busy": None}
    wall = max(w["wall_s"] for w in windows)
    own = sum(w["process_cpu_s"] for w in windows) / (wall * (os.cpu_count() or 1)) \
        if wall > 0 else None
    return {"cpu_busy": windows[0]["cpu_busy"], "workers_busy": own}


def summarize_baseline(ranks: list[dict]) -> dict[str, Any]:
    """The run's reference numbers from the baseline phase's per-rank results."""
    fwd = _max_over_ranks(ranks, "forward_s")
    bwd = _max_over_ranks(ranks, "backward_s")
    optim = _max_over_ranks(ranks, "optimizer_s")
    compute = fwd + bwd + optim
    comm = _max_over_ranks(ranks, "comm_s")
    fwd_uc = _max_over_ranks(ranks, "forward_under_comm_s")
    bwd_uc = _max_over_ranks(ranks, "backward_under_comm_s")
    opt_uc = _max_over_ranks(ranks, "optimizer_under_comm_s")
    spans = ranks[0]["under_comm_span_s"]
    lower = max(compute, comm)
    return {
        "forward_s": fwd,
        "backward_s": bwd,
        "optimizer_s": optim,
        "compute_s": compute,
        "compute_one_worker_s": median(ranks[0]["one_worker_s"]),
        "comm_s": comm,
        "comm_cpu_busy": cpu_use(ranks, "comm_cpu")["cpu_busy"],
        "comm_workers_cpu_busy": cpu_use(ranks, "comm_cpu")["workers_busy"],
        "forward_under_comm_s": fwd_uc,
        "backward_under_comm_s": bwd_uc,
        "compute_under_comm_s": fwd_uc + bwd_uc + opt_uc,
        # Below 1 the all-reduce ended before compute did: only part of the
        # compute ran under communication.
        "under_comm_coverage": min(1.0, median([c / max(k, 1e-9) for k, c in spans])),
        "lower_bound_s": lower,
        "no_overlap_s": compute + comm,
        "ddp_model_s": fwd + max(bwd, comm) + optim,
        "ceiling_speedup_vs_ddp": (fwd + max(bwd, comm) + optim) / lower,
    }


def result_entry(strategy: str, status: str, **fields: Any) -> dict[str, Any]:
    """A ``results[]`` entry with exactly :data:`RESULT_KEYS` (unset ones ``None``)."""
    unknown = set(fields) - set(RESULT_KEYS)
    if unknown:
        raise KeyError(f"not result keys: {sorted(unknown)}; add them to RESULT_KEYS and docs/bench.md")
    entry: dict[str, Any] = dict.fromkeys(RESULT_KEYS)
    entry.update(strategy=strategy, status=status, **fields)
    return entry


def step_fields(steps: Sequence[float], samples_per_step: int, baseline: dict | None) -> dict[str, Any]:
    """The step-time fields of an entry from its measured step times (seconds)."""
    step = median(steps)
    p25, p75 = quantile(steps, 0.25), quantile(steps, 0.75)
    fields: dict[str, Any] = {
        "measured_steps": len(steps),
        "step_time_s": step,
        "step_time_p25_s": p25,
        "step_time_p75_s": p75,
        "step_time_iqr_s": p75 - p25,
        "mean_step_time_s": sum(steps) / len(steps),
        "throughput_samples_s": samples_per_step / step,
    }
    if baseline is not None and baseline.get("comm_s") and baseline.get("compute_s") is not None:
        comm, compute = baseline["comm_s"], baseline["compute_s"]
        fields["overlap_ratio"] = (compute + comm - step) / comm
        fields["efficiency"] = baseline["lower_bound_s"] / step
    return fields


def summarize_strategy(phase: Any, baseline: dict | None, samples_per_step: int
                       ) -> dict[str, Any]:
    """One strategy's entry of the report (``phase`` is a runner.PhaseResult)."""
    if phase.status != "ok":
        return result_entry(phase.name, phase.status, reason=phase.reason)
    r0 = phase.ranks[0]
    steps = r0["step_times_s"]
    bubble, method = _bubble(phase.ranks, baseline)
    fields = step_fields(steps, samples_per_step, baseline)
    fields["mean_step_time_s"] = r0["total_s"] / len(steps)
    stats = r0.get("stats") or {}
    return result_entry(
        phase.name, "ok", **fields,
        step_time_per_rank_s=[median(r["step_times_s"]) for r in phase.ranks],
        bubble_s=bubble,
        bubble_method=method,
        forward_s=_max_over_ranks(phase.ranks, "forward_s"),
        backward_s=_max_over_ranks(phase.ranks, "backward_s"),
        step_call_s=_max_over_ranks(phase.ranks, "step_call_s"),
        **_cpu_fields(phase.ranks),
        params_consistent=len({r["checksum"] for r in phase.ranks}) == 1,
        pieces_per_step=r0.get("pieces_per_step"),
        timeline=r0.get("timeline"),
        stats=stats,
    )


def _cpu_fields(ranks: list[dict]) -> dict[str, Any]:
    use = cpu_use(ranks, "cpu")
    busy = use["cpu_busy"]
    return {"cpu_busy": busy, "workers_cpu_busy": use["workers_busy"],
            "cpu_warning": busy is not None and busy > BUSY_WARNING}


def _bubble(ranks: list[dict], baseline: dict | None) -> tuple[float | None, str]:
    """Median per-step blocked time, and how it was obtained."""
    r0 = ranks[0]
    method = r0.get("bubble_method", "")
    if r0.get("bubble_s") is not None:
        per_rank = [median(r["bubble_s"]) for r in ranks if r.get("bubble_s")]
        per_rank = [b for b in per_rank if b is not None]
        return (max(per_rank) if per_rank else 0.0), method
    if baseline is None:
        return None, method + " (no baseline: not estimated)"
    if method.startswith("backward()"):  # DDP
        blocked = [max(0.0, b - baseline["backward_under_comm_s"]) for b in r0["backward_s"]]
    elif method.startswith("step()"):  # Horovod
        blocked = [max(0.0, s - baseline["optimizer_s"]) for s in r0["step_call_s"]]
    else:
        return None, method + " (strategy reports none)"
    return median(blocked), method


def build_report(config: dict, emulation: str, emulation_note: str, workload: dict,
                 baseline_phase: Any, phases: list[Any], framework: str = "torch") -> dict[str, Any]:
    """The whole JSON document (docs/bench.md) from the runner's phases (torch's workload benchmark)."""
    warnings: list[str] = []
    baseline = None
    if baseline_phase.status == "ok":
        baseline = summarize_baseline(baseline_phase.ranks)
        r0 = baseline_phase.ranks[0]
        workload = {**workload, "param_bytes": r0["param_bytes"],
                    "num_params": r0["num_params"], "layers": r0.get("layers", [])}
        busy = baseline.get("comm_cpu_busy")
        if busy is not None and busy > BUSY_WARNING:
            warnings.append(f"CPU busy {busy:.2f} during the all-reduce alone (workers "
                            f"{_fmt(baseline['comm_workers_cpu_busy'], '.2f')}): the CPUs, "
                            "not the emulated link, may limit communication")
    else:
        warnings.append(f"baseline failed: {baseline_phase.reason}")
    samples = config["batch_size"] * config["workers"]
    results = [summarize_strategy(p, baseline, samples) for p in phases]
    return assemble_report(framework, config, emulation, emulation_note, workload, baseline, results, warnings)


def reference_baseline(compute_s: float | None, comm_s: float | None) -> dict[str, Any] | None:
    """A ``baseline`` block from a compute-only and a communication-only step time.

    The MLP benchmarks (TensorFlow, MXNet) measure these as their ``compute``
    and ``comm`` strategies; what they do not measure is ``None``.
    """
    if compute_s is None or comm_s is None:
        return None
    block: dict[str, Any] = dict.fromkeys(BASELINE_KEYS)
    block.update(compute_s=compute_s, comm_s=comm_s, lower_bound_s=max(compute_s, comm_s),
                 no_overlap_s=compute_s + comm_s)
    return block


def assemble_report(framework: str, config: dict, emulation: str, emulation_note: str, workload: dict,
                    baseline: dict | None, results: list[dict], warnings: list[str] | None = None
                    ) -> dict[str, Any]:
    """The document from finished entries: speedups against the framework's
    baseline strategy, warnings, and every key of :data:`REPORT_KEYS`."""
    if framework not in BASELINE_STRATEGY:
        raise ValueError(f"framework {framework!r} is not one of {', '.join(BASELINE_STRATEGY)}")
    missing = set(CONFIG_KEYS) - set(config)
    if missing:
        raise KeyError(f"config lacks {sorted(missing)}")
    warnings = list(warnings or [])
    reference = BASELINE_STRATEGY[framework]
    ref = next((r for r in results if r["strategy"] == reference and r["status"] == "ok"), None)
    for r in results:
        if r["status"] == "ok" and ref is not None:
            r["speedup_vs_baseline"] = ref["step_time_s"] / r["step_time_s"]
        if r.get("cpu_warning"):
            warnings.append(
                f"{r['strategy']}: CPU busy {r['cpu_busy']:.2f} > {BUSY_WARNING} (this benchmark's "
                f"workers: {_fmt(r['workers_cpu_busy'], '.2f')}): timings may be CPU-bound "
                "rather than network-bound")
        if r["status"] == "ok" and r["efficiency"] is not None and r["efficiency"] > 1.05:
            warnings.append(f"{r['strategy']}: step {r['step_time_s']:.3f} s beats the lower "
                            "bound measured in the baseline: the CPU load changed between "
                            "phases (other processes?); compare with care")
        if r["status"] == "ok" and r["params_consistent"] is False:
            warnings.append(f"{r['strategy']}: ranks ended with different parameters")
    return {
        "schema": SCHEMA,
        "framework": framework,
        "predicted": False,
        "baseline_strategy": reference,
        "config": config,
        "emulation": emulation,
        "emulation_note": emulation_note,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "machine": platform.machine()},
        "workload": {**dict.fromkeys(WORKLOAD_KEYS), **workload},
        "baseline": baseline,
        "results": results,
        "warnings": warnings,
    }


def _fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _link(report: dict) -> str:
    """What the links were, e.g. "1gbit (netns)" or "unshaped (loopback)"."""
    rate = report["config"]["bandwidth"] if report["emulation"] == "netns" else None
    return f"{rate or 'unshaped'} ({report['emulation']})"


#: The table's header, the same for every framework (the baseline strategy is named above it).
TABLE_HEADER = ("| strategy | step s (median) | IQR s | samples/s | speedup vs baseline (ceiling) "
                "| bubble s | overlap | efficiency | CPU busy (workers) | pieces/step |")


def markdown(report: dict) -> str:
    """The report as a markdown summary and table, for stdout."""
    cfg, base, wl = report["config"], report["baseline"], report["workload"]
    lines = [
        (f"## commsched bench ({report['framework']}): {cfg['workload']}, {cfg['workers']} workers on "
         f"{cfg['nodes']} node(s), {_link(report)}"),
        "",
        f"- emulation: **{report['emulation']}** ({report['emulation_note']})",
        (f"- workload: {wl.get('description') or wl.get('name') or ''}; "
         f"{_fmt(wl.get('param_bytes') and wl['param_bytes'] / 1e6, '.1f')} MB of parameters, "
         f"batch {cfg['batch_size']} per worker"),
        f"- speedups are relative to **{report['baseline_strategy']}**",
    ]
    if base:
        if base["forward_s"] is not None:
            lines.append(
                f"- compute {base['compute_s']:.3f} s (forward {base['forward_s']:.3f}, backward "
                f"{base['backward_s']:.3f}, optimizer {base['optimizer_s']:.3f}; one worker alone "
                f"{_fmt(base['compute_one_worker_s'])}), under a concurrent all-reduce "
                f"{_fmt(base['compute_under_comm_s'])} s")
        else:
            lines.append(f"- compute (one worker alone) {base['compute_s']:.3f} s")
        lines.append(
            f"- comm (all-reduce of all gradients) {base['comm_s']:.3f} s, CPU busy "
            f"{_fmt(base['comm_cpu_busy'], '.2f')} (workers "
            f"{_fmt(base['comm_workers_cpu_busy'], '.2f')})")
        ceiling = ""
        if base["ceiling_speedup_vs_ddp"] is not None:
            ceiling = (f"; speedup ceiling vs ddp (forward + max(backward, comm) + optimizer) / "
                       f"max(compute, comm) = {base['ceiling_speedup_vs_ddp']:.2f}x")
        lines.append(f"- lower bound max(compute, comm) {base['lower_bound_s']:.3f} s; no overlap "
                     f"{base['no_overlap_s']:.3f} s{ceiling}")
    lines += ["", TABLE_HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ceiling = base and base["ceiling_speedup_vs_ddp"]
    for r in report["results"]:
        if r["status"] != "ok":
            reason = (r.get("reason") or "").splitlines()[0][:100] if r.get("reason") else ""
            lines.append(f"| {r['strategy']} | {r['status']}: {reason} ||||||||| ")
            continue
        speed = _fmt(r["speedup_vs_baseline"], ".2f", "x")
        if ceiling:
            speed += f" ({ceiling:.2f}x)"
        busy = (_fmt(r["cpu_busy"], ".2f") + (" (!)" if r["cpu_warning"] else "")
                + f" ({_fmt(r['workers_cpu_busy'], '.2f')})")
        lines.append(
            f"| {r['strategy']} | {r['step_time_s']:.3f} | {r['step_time_iqr_s']:.3f} "
            f"| {r['throughput_samples_s']:.1f} | {speed} | {_fmt(r['bubble_s'])} "
            f"| {_fmt(r['overlap_ratio'], '.2f')} | {_fmt(r['efficiency'], '.2f')} | {busy} "
            f"| {_fmt(r['pieces_per_step'], '.0f')} |"
        )
    if report["warnings"]:
        lines += ["", "Warnings:"] + [f"- {w}" for w in report["warnings"]]
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    """Write ``report`` to ``path`` (parent directories created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def plot(report: dict, path: str) -> None:
    """PNG: median step time per strategy (IQR whiskers), the lower bound
    max(compute, comm) and the no-overlap time compute + comm as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(1.2 * max(4, len(ok)) + 2, 4.2))
    names = [r["strategy"] for r in ok]
    steps = [r["step_time_s"] for r in ok]
    err = [[r["step_time_s"] - r["step_time_p25_s"] for r in ok],
           [r["step_time_p75_s"] - r["step_time_s"] for r in ok]]
    bars = ax.bar(names, steps, yerr=err, capsize=4, color="#4C72B0")
    for bar, value in zip(bars, steps, strict=True):
        # Inside the bar, off-centre: the IQR whisker runs through its middle.
        ax.annotate(f"{value:.3f}", (bar.get_x() + bar.get_width() * 0.28, value),
                    ha="center", va="top", fontsize=8, color="white", xytext=(0, -3),
                    textcoords="offset points")
    base = report["baseline"]
    if base:
        ax.axhline(base["lower_bound_s"], color="#2CA02C", linestyle="--",
                   label=f"lower bound max(compute, comm) = {base['lower_bound_s']:.3f} s")
        ax.axhline(base["no_overlap_s"], color="#D62728", linestyle=":",
                   label=f"no overlap compute + comm = {base['no_overlap_s']:.3f} s")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8,
                  frameon=False)
    cfg = report["config"]
    ax.set_ylabel("step time, s (median, IQR)")
    ax.set_title(f"{cfg['workload']}: {cfg['workers']} workers, {cfg['nodes']} node(s), "
                 f"{_link(report)}", fontsize=10)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
