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
- ``overlap_ratio``: the share of the communication time hidden behind compute,
  ``1 - exposed_comm_s / comm_s`` clamped to [0, 1] (1 = all hidden, 0 = none).
  ``exposed_comm_s`` is the step's bubble, the time the training thread blocked
  on communication, where the report has one (commsched and ``allreduce``
  measure it; DDP's and Horovod's are estimated, see ``bubble_method``), else
  ``max(0, step_time_s - compute_s)``; ``overlap_method`` says which. It is
  ``None`` ("n/a" in the table) when ``comm_s`` is below the noise floor
  ``max(OVERLAP_FLOOR_S, OVERLAP_FLOOR_OF_COMPUTE * compute_s)`` (2 ms, 5 % of
  compute): a ratio of two numbers smaller than the step's jitter says nothing.
  It says how much communication was hidden, not how fast the step was: a
  strategy that hides all of it but slows compute down (CPU contention,
  scheduler overhead) has overlap 1 and a low ``efficiency``;
- ``efficiency = lower_bound_s / step_time_s``;
- ``contended_bound_s = max(compute_under_comm_s, comm_s)``: the bound issue 13 judges
  efficiency against, where compute and communication share the machine's CPUs (compute
  measured beside a concurrent all-reduce); ``efficiency_contended = contended_bound_s /
  step_time_s`` (``None`` where the baseline did not measure compute under communication);
- ``dependency_bound_s`` (torch: from rank 0's per-layer profile, else ``None``): the dependency
  bound of :mod:`commsched.costmodel.bounds`, ``max(compute, comm)`` plus what the next forward's
  need for a layer whose gradient backward makes late adds; ``dependency_layer`` names that layer
  (``None`` where compute or comm alone binds); ``combined_bound_s = max(contended_bound_s,
  dependency_bound_s)`` and ``efficiency_combined = combined_bound_s / step_time_s`` (``None`` for a
  strategy the bound does not hold for: :func:`beats_dependency`);
- ``ddp_model_s = forward_s + max(backward_s, comm_s) + optimizer_s``: DDP
  overlaps communication with backward only, so it pays about that;
- ``ceiling_speedup_vs_ddp = ddp_model_s / lower_bound_s``: what perfect
  scheduling could gain over DDP (torch only). When communication outlasts backward this is
  ``(forward + comm) / max(compute, comm)`` (plus the optimizer step); when
  backward hides it, 1 -- nothing to gain (the plain formula would give < 1);
- ``speedup_vs_baseline = baseline step time / step time``, where the baseline
  is the framework's stock strategy named by ``baseline_strategy`` (``ddp``,
  ``mwms``, ``dist_sync``); with ``--rounds R`` > 1 (every framework), the median over the
  rounds of that ratio within each round (a paired ratio: a slow stretch of the
  machine that hits both phases of a round cancels), ``step_time_s`` the median
  of the rounds' medians and ``rounds`` each round's figures (:func:`rounds_entry`);
- ``cpu_steal``: the share of the machine's CPU time its hypervisor gave to other
  guests during the phase (``/proc/stat``'s steal; part of ``cpu_busy``);
- ``breakdown`` (torch): where one step's time goes, per strategy (:func:`breakdown`;
  each number says how it was measured in ``breakdown["how"]``);
- ``calibration`` (torch): the regime each workload is meant to be in, the one it
  measured in (``compute_s / comm_s``, :func:`regime_of`) and, with ``--calibrate``,
  how the batch size was chosen.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from typing import Any

from commsched.bench.cpu import BUSY_WARNING
from commsched.costmodel.bounds import bound_by_bytes
from commsched.tuner import Settings

SCHEMA = "commsched-bench/2"

#: The stock strategy each framework's speedups are relative to.
BASELINE_STRATEGY = {"torch": "ddp", "tensorflow": "mwms", "mxnet": "dist_sync"}

#: Keys of the whole document.
REPORT_KEYS = ("schema", "framework", "predicted", "baseline_strategy", "config", "emulation",
               "emulation_note", "host", "workload", "baseline", "calibration", "results", "warnings")
#: Keys of ``config``.
CONFIG_KEYS = ("workload", "workers", "nodes", "bandwidth", "intra_bandwidth", "strategies", "steps",
               "warmup", "baseline_steps", "batch_size", "partition_bytes", "credit_bytes", "network",
               "seed", "extra")
#: Keys of ``workload``.
WORKLOAD_KEYS = ("name", "description", "param_bytes", "num_params", "layers")
#: Keys of ``baseline`` (the reference measurements), when it is not ``null``.
BASELINE_KEYS = ("forward_s", "backward_s", "optimizer_s", "compute_s", "compute_one_worker_s", "comm_s",
                 "comm_cpu_busy", "comm_workers_cpu_busy", "forward_under_comm_s", "backward_under_comm_s",
                 "compute_under_comm_s", "under_comm_coverage", "comm_under_compute_s", "comm_contention",
                 "lower_bound_s", "contended_bound_s", "dependency_bound_s", "dependency_layer",
                 "combined_bound_s", "no_overlap_s",
                 "ddp_model_s", "ceiling_speedup_vs_ddp", "stream_allreduces", "stream_alone_s",
                 "compute_under_stream_s", "stream_coverage", "contention")
#: Keys of every ``results[]`` entry, whatever its status.
RESULT_KEYS = ("strategy", "status", "reason", "measured_steps", "step_time_s", "step_time_p25_s",
               "step_time_p75_s", "step_time_iqr_s", "mean_step_time_s", "step_time_per_rank_s",
               "throughput_samples_s", "speedup_vs_baseline", "bubble_s", "bubble_method", "forward_s",
               "backward_s", "step_call_s", "overlap_ratio", "efficiency", "efficiency_contended",
               "efficiency_combined", "cpu_busy", "workers_cpu_busy",
               "cpu_warning", "params_consistent", "pieces_per_step", "timeline", "stats", "logs",
               "exposed_comm_s", "overlap_method", "breakdown", "cpu_steal", "rounds", "rerun_steal")
#: Keys of every ``results[].rounds[]`` entry (``--rounds`` > 1; ``rounds`` is ``null`` otherwise).
ROUND_KEYS = ("round", "position", "status", "step_time_s", "step_time_iqr_s", "speedup_vs_baseline",
              "cpu_busy", "cpu_steal", "plan", "tuner", "step_times_s", "rerun_steal")
#: Keys of ``results[].rounds[].tuner`` (``auto``: what that round's tuner kept; ``null`` otherwise).
ROUND_TUNER_KEYS = ("kept", "score_s", "samples", "verdict", "history", "favoured", "favoured_by")
#: Keys of ``results[].rounds[].plan`` (``planned``: the plan that round ran; ``null`` otherwise).
ROUND_PLAN_KEYS = ("digest", "predicted_step_s", "groups", "pieces", "credit_bytes", "algorithms", "order", "plan_s",
                   "profile_drift", "engine", "bucket_bytes", "planner_order", "planner_digest")
#: Keys of ``calibration``, when it is not ``null``.
CALIBRATION_KEYS = ("expected_regime", "measured_regime", "compute_over_comm", "matches", "calibrated",
                    "default_batch_size", "batch_size", "target_compute_over_comm", "trials", "method")

#: Below ``max(OVERLAP_FLOOR_S, OVERLAP_FLOOR_OF_COMPUTE * compute_s)`` of communication the
#: overlap ratio is ``None``: step-to-step jitter is of that size.
OVERLAP_FLOOR_S = 0.002
OVERLAP_FLOOR_OF_COMPUTE = 0.05

#: The regimes a workload can be in, by ``compute_s / comm_s``: ``balanced`` within a factor
#: :data:`BALANCED_BAND` of 1, ``comm-bound`` below, ``compute-bound`` above.
REGIMES = ("comm-bound", "balanced", "compute-bound")
BALANCED_BAND = 1.25
#: What ``--calibrate`` aims ``compute_s / comm_s`` at for each regime.
REGIME_TARGET = {"comm-bound": 0.5, "balanced": 1.0, "compute-bound": 2.0}


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
        return {"cpu_busy": None, "workers_busy": None, "steal": None}
    wall = max(w["wall_s"] for w in windows)
    own = sum(w["process_cpu_s"] for w in windows) / (wall * (os.cpu_count() or 1)) \
        if wall > 0 else None
    return {"cpu_busy": windows[0]["cpu_busy"], "workers_busy": own, "steal": windows[0].get("cpu_steal")}


def comm_contention(spans: Sequence[Sequence[float]], comm_alone_s: float | None) -> float | None:
    """How many times slower the all-reduce ran while compute ran beside it (>= 1).

    ``spans``: per repetition, (compute ended, all-reduce ended), both from the
    all-reduce's start; ``comm_alone_s``: the same all-reduce with nothing beside it.
    When the all-reduce ended first (c <= k) all of it ran under compute: λ = c / C.
    Otherwise its first k seconds ran at 1/λ and the rest at full speed:
    C = k/λ + (c - k), so λ = k / (C - (c - k)); a repetition whose tail alone took
    longer than C (a slow outlier) says nothing and is skipped. The median of the
    repetitions, at least 1; ``None`` without a usable one.
    """
    if not comm_alone_s or comm_alone_s <= 0:
        return None
    values = []
    for k, c in spans:
        if c <= k:
            values.append(c / comm_alone_s)
        elif comm_alone_s - (c - k) > 0:
            values.append(k / (comm_alone_s - (c - k)))
    lam = median(values)
    return None if lam is None else max(1.0, lam)


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
    under = fwd_uc + bwd_uc + opt_uc
    dependency = _dependency(ranks[0].get("layers"), fwd, bwd, optim, comm, max(under, comm))
    block = {
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
        "compute_under_comm_s": under,
        # Below 1 the all-reduce ended before compute did: only part of the
        # compute ran under communication.
        "under_comm_coverage": coverage(spans),
        # the other way round: the all-reduce under compute / alone (rank 0's own medians)
        "comm_under_compute_s": median([c for _, c in spans]),
        "comm_contention": comm_contention(spans, median(ranks[0].get("comm_s") or [])),
        "lower_bound_s": lower,
        "contended_bound_s": max(under, comm),
        **dependency,
        "no_overlap_s": compute + comm,
        "ddp_model_s": fwd + max(bwd, comm) + optim,
        "ceiling_speedup_vs_ddp": (fwd + max(bwd, comm) + optim) / lower,
        **_stream(ranks),
    }
    block["contention"] = contention_from(block)[0]
    return block


def coverage(spans: Sequence[Sequence[float]]) -> float:
    """The median share of a compute's wall time that communication started with it lasted, at most 1,
    from ``(compute ended, communication ended)`` pairs, both from their common start."""
    return min(1.0, median([end / max(compute, 1e-9) for compute, end in spans]) or 0.0)


def _stream(ranks: list[dict]) -> dict[str, Any]:
    """The baseline's stream phase (``run_baseline``'s ``stream``: compute beside all-reduces that
    outlast it, each such step after one alone): the slowest rank's medians, rank 0's coverage."""
    streams = [r.get("stream") or {} for r in ranks]
    if not streams or not streams[0].get("count"):
        return dict.fromkeys(("stream_allreduces", "stream_alone_s", "compute_under_stream_s", "stream_coverage"))
    alone = [median([sum(t) for t in s["alone_s"]]) for s in streams if s.get("alone_s")]
    under = [median([sum(t) for t in s["under_s"]]) for s in streams if s.get("under_s")]
    return {"stream_allreduces": streams[0]["count"], "stream_alone_s": max(alone) if alone else None,
            "compute_under_stream_s": max(under) if under else None,
            "stream_coverage": coverage(streams[0]["span_s"])}


def _contention_note(base: dict[str, Any]) -> str:
    """The markdown's words for the baseline's ``contention``."""
    if base.get("contention") is None:
        return ""
    if base.get("stream_allreduces"):
        return (f"; compute runs {base['contention']:.2f}x slower beside communication (beside a stream of "
                f"{base['stream_allreduces']} all-reduces, coverage {base['stream_coverage']:.2f}: "
                f"{_fmt(base['compute_under_stream_s'])} s against {_fmt(base['stream_alone_s'])} s alone)")
    return f"; compute runs {base['contention']:.2f}x slower beside communication"


def contention_from(baseline: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """``(kappa, how)``: how many times slower compute runs while communication is in flight (the
    simulator's ``Profile.contention``), from a baseline block.

    With the stream phase: compute beside all-reduces that outlast it over the same compute alone,
    each pair measured back to back. Without (older reports, other frameworks): compute beside one
    all-reduce over the compute phase's. When the communication ended first (coverage c < 1 of
    the compute's wall time U under it), only its first c·U ran slowed by κ: U = c·U + (C − c·U/κ),
    so κ = c·U / (C − (1 − c)·U). At least 1."""
    if baseline.get("compute_under_stream_s") and baseline.get("stream_alone_s"):
        compute, under = baseline["stream_alone_s"], baseline["compute_under_stream_s"]
        cover, source = baseline.get("stream_coverage") or 1.0, "stream"
        what = ("compute beside a stream of all-reduces that outlasts it / the same compute alone, each pair "
                "back to back")
    else:
        compute, under = baseline["compute_s"], baseline["compute_under_comm_s"]
        cover, source = baseline["under_comm_coverage"], "one all-reduce"
        what = ("compute_under_comm_s / compute_s, corrected for the part of the compute the all-reduce did "
                "not overlap (coverage < 1)")
    raw = under / compute if compute > 0 else 1.0
    kappa = raw
    denom = compute - (1 - cover) * under
    if cover < 1 and denom > 0:
        kappa = cover * under / denom
    kappa = max(1.0, kappa)
    return kappa, {"raw_ratio": raw, "coverage": cover, "value": kappa, "source": source, "how": what}


def dependency_block(bound: Any, names: Sequence[str], contended_s: float) -> dict[str, Any]:
    """The baseline's ``dependency_bound_s``, ``dependency_layer`` and ``combined_bound_s`` (module
    docstring) from a :class:`commsched.costmodel.bounds.DependencyBound` (``None``: no bound; all
    three ``None``), the layers' ``names`` and the contended bound."""
    if bound is None:
        return {"dependency_bound_s": None, "dependency_layer": None, "combined_bound_s": None}
    return {"dependency_bound_s": bound.step_s,
            "dependency_layer": None if bound.layer is None else names[bound.layer],
            "combined_bound_s": max(contended_s, bound.step_s)}


def _dependency(layers: list[dict] | None, forward_s: float, backward_s: float, optimizer_s: float,
                comm_s: float, contended_s: float) -> dict[str, Any]:
    """:func:`dependency_block` from rank 0's per-layer profile (``layers``: bytes, forward ms and
    gradient-ready ms, measured alone), its times scaled to the baseline's forward and backward;
    ``None`` fields without a usable profile (TensorFlow, MXNet)."""
    rows = layers or []
    usable = rows and all(r.get("forward_ms") is not None and not math.isnan(r["forward_ms"]) for r in rows)
    fwd_ms = sum(r["forward_ms"] for r in rows) if usable else 0.0
    ready_ms = max((r["grad_ready_ms"] or 0.0) for r in rows) if usable else 0.0
    bound = None
    if fwd_ms > 0 and ready_ms > 0:
        bound = bound_by_bytes([forward_s * r["forward_ms"] / fwd_ms for r in rows],
                               [None if r["grad_ready_ms"] is None else backward_s * r["grad_ready_ms"] / ready_ms
                                for r in rows],
                               [int(r["param_bytes"]) for r in rows], backward_s=backward_s, comm_s=comm_s,
                               optimizer_s=optimizer_s)
    return dependency_block(bound, [r["layer"] for r in rows], contended_s)


def overlap_ratio(comm_s: float | None, compute_s: float | None, step_s: float | None,
                  exposed_s: float | None = None) -> tuple[float | None, float | None, str]:
    """``(overlap, exposed, method)``: the share of ``comm_s`` hidden behind compute.

    ``overlap = clamp(1 - exposed / comm_s, 0, 1)``. ``exposed_s`` is the measured (or
    estimated) bubble when the caller has one; without it, the time the step took beyond
    compute, ``max(0, step_s - compute_s)``. ``overlap`` is ``None`` when ``comm_s`` is
    below the noise floor (module docstring) or an input is missing.
    """
    if comm_s is None or compute_s is None or step_s is None:
        return None, exposed_s, "no baseline: not computed"
    if exposed_s is None:
        exposed_s, method = max(0.0, step_s - compute_s), "exposed = max(0, step - compute)"
    else:
        method = "exposed = the bubble (time blocked on communication)"
    floor = max(OVERLAP_FLOOR_S, OVERLAP_FLOOR_OF_COMPUTE * compute_s)
    if comm_s < floor:
        return None, exposed_s, (f"n/a: comm {comm_s * 1e3:.2f} ms is below the noise floor "
                                 f"{floor * 1e3:.2f} ms (max(2 ms, 5 % of compute))")
    return min(1.0, max(0.0, 1.0 - exposed_s / comm_s)), exposed_s, method


def regime_of(compute_s: float | None, comm_s: float | None) -> str | None:
    """``comm-bound``, ``balanced`` or ``compute-bound`` by ``compute_s / comm_s`` (:data:`REGIMES`)."""
    if not compute_s or not comm_s:
        return None
    ratio = compute_s / comm_s
    if ratio < 1 / BALANCED_BAND:
        return "comm-bound"
    return "balanced" if ratio <= BALANCED_BAND else "compute-bound"


def calibration_block(expected: str | None, baseline: dict | None, *, calibrated: bool = False,
                      default_batch_size: int | None = None, batch_size: int | None = None,
                      trials: list[dict] | None = None, method: str | None = None) -> dict[str, Any]:
    """The report's ``calibration``: the regime the workload is named for and the one the
    baseline measured (``compute_s / comm_s``), and how the batch size was chosen."""
    compute = baseline.get("compute_s") if baseline else None
    comm = baseline.get("comm_s") if baseline else None
    measured = regime_of(compute, comm)
    return {
        "expected_regime": expected,
        "measured_regime": measured,
        "compute_over_comm": compute / comm if compute and comm else None,
        "matches": None if expected is None or measured is None else expected == measured,
        "calibrated": calibrated,
        "default_batch_size": default_batch_size,
        "batch_size": batch_size,
        "target_compute_over_comm": REGIME_TARGET.get(expected or ""),
        "trials": trials or [],
        "method": method or ("not calibrated (--calibrate chooses the batch size): the regime is measured "
                             "in the baseline phase, compute_s / comm_s"),
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
    if baseline is not None and baseline.get("comm_s") is not None and baseline.get("compute_s") is not None:
        fields["overlap_ratio"], fields["exposed_comm_s"], fields["overlap_method"] = overlap_ratio(
            baseline["comm_s"], baseline["compute_s"], step)
        fields["efficiency"] = baseline["lower_bound_s"] / step
        fields["efficiency_contended"] = _against(baseline, "contended_bound_s", step)
        fields["efficiency_combined"] = _against(baseline, "combined_bound_s", step)
    return fields


#: The strategies that may run the two-level algorithm on several nodes (a plan, or every piece
#: two-level), which moves fewer bytes across nodes than the baseline's flat all-reduce.
TWO_LEVEL_STRATEGIES = ("planned", "hierarchical", "auto")


def beats_dependency(strategy: str, two_level: bool = False) -> bool:
    """Whether ``strategy`` may change what the dependency bound assumes, so that the bound says
    nothing of it and its ``efficiency_combined`` is ``None``: ``+tied`` (the tied embedding's
    gradient split, most of it reduced early) and, where the cluster has several nodes of several
    ranks (``two_level``), a strategy that may run the two-level algorithm
    (:data:`TWO_LEVEL_STRATEGIES`; the bound takes the baseline's flat all-reduce: 2 x 2 balanced's
    ``planned`` ran 1.798 s against a bound of 1.822)."""
    kind, *mods = strategy.split("+")
    return "tied" in mods or (two_level and kind.split(":")[0] in TWO_LEVEL_STRATEGIES)


def _without_uncovered(results: list[dict], config: dict) -> list[dict]:
    """``results`` with ``efficiency_combined`` ``None`` where :func:`beats_dependency` (``config``:
    the run's, its ``workers`` and ``nodes``)."""
    nodes = int(config.get("nodes") or 1)
    two_level = 1 < nodes < int(config.get("workers") or 1)
    return [{**r, "efficiency_combined": None} if beats_dependency(r["strategy"], two_level) else r
            for r in results]


def _against(baseline: dict, key: str, step: float) -> float | None:
    """``baseline[key] / step`` (an efficiency against that bound), or None without the bound."""
    bound = baseline.get(key)
    return bound / step if bound is not None and step else None


def summarize_strategy(phase: Any, baseline: dict | None, samples_per_step: int
                       ) -> dict[str, Any]:
    """One strategy's entry of the report (``phase`` is a runner.PhaseResult)."""
    rerun = list(phase.discarded_steal) or None
    if phase.status != "ok":
        return result_entry(phase.name, phase.status, reason=phase.reason, rerun_steal=rerun)
    r0 = phase.ranks[0]
    steps = r0["step_times_s"]
    bubble, method = _bubble(phase.ranks, baseline)
    fields = step_fields(steps, samples_per_step, baseline)
    fields["mean_step_time_s"] = r0["total_s"] / len(steps)
    stats = r0.get("stats") or {}
    if baseline is not None and bubble is not None:  # the measured (or estimated) bubble is the exposed time
        fields["overlap_ratio"], fields["exposed_comm_s"], fields["overlap_method"] = overlap_ratio(
            baseline["comm_s"], baseline["compute_s"], fields["step_time_s"], bubble)
        fields["overlap_method"] += f" ({method})" if fields["overlap_ratio"] is not None else ""
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
        breakdown=breakdown(phase),
        rerun_steal=rerun,
    )


def summarize_rounds(phases: Sequence[Any], baseline: dict | None, samples_per_step: int) -> dict[str, Any]:
    """One strategy's entry from its phases of an interleaved run (``--rounds``; one phase per round):
    :func:`rounds_entry` over each phase's own entry."""
    return rounds_entry([(p.round, p.position, summarize_strategy(p, baseline, samples_per_step),
                          p.ranks[0]["step_times_s"] if p.status == "ok" else [])
                         for p in phases], baseline, samples_per_step)


def rounds_entry(runs: Sequence[tuple[int, int, dict[str, Any], Sequence[float]]], baseline: dict | None,
                 samples_per_step: int) -> dict[str, Any]:
    """One strategy's entry from its runs of an interleaved benchmark (``--rounds``, any framework):
    ``runs`` holds (round, position, that run's own entry, its measured step times), both 0-based.

    ``step_time_s`` is the median of the rounds' medians (one slow round moves it little); the
    quantiles and the mean pool every round's steps; the other fields (bubble, breakdown, stats,
    CPU) are those of the round whose median is nearest ``step_time_s``, with overlap and
    efficiency recomputed for ``step_time_s``. ``rounds`` lists each round (:data:`ROUND_KEYS`);
    :func:`assemble_report` fills its paired ``speedup_vs_baseline``. A failed round is listed,
    its reason kept, and left out of the figures; every round failed: the first failure's entry.
    """
    rounds = [{**dict.fromkeys(ROUND_KEYS), "round": r + 1, "position": pos + 1, "status": e["status"],
               "step_time_s": e["step_time_s"], "step_time_iqr_s": e["step_time_iqr_s"], "cpu_busy": e["cpu_busy"],
               "cpu_steal": e["cpu_steal"], "plan": round_plan(e.get("stats")), "tuner": round_tuner(e.get("stats")),
               "step_times_s": [round(t, 6) for t in steps or []], "rerun_steal": e.get("rerun_steal")}
              for r, pos, e, steps in runs]
    reruns = [x for _, _, e, _ in runs for x in e.get("rerun_steal") or []]
    ok = [(e, steps) for _, _, e, steps in runs if e["status"] == "ok"]
    if not ok:
        return {**runs[0][2], "rounds": rounds, "rerun_steal": reruns or None}
    step = median([e["step_time_s"] for e, _ in ok])
    rep, _ = min(ok, key=lambda es: abs(es[0]["step_time_s"] - step))
    pooled = [t for _, steps in ok for t in steps]
    fields = step_fields(pooled, samples_per_step, baseline)
    fields["step_time_s"] = step
    fields["throughput_samples_s"] = samples_per_step / step
    fields["mean_step_time_s"] = sum(e["mean_step_time_s"] * e["measured_steps"] for e, _ in ok) / len(pooled)
    if baseline is not None and baseline.get("lower_bound_s") is not None:
        fields["efficiency"] = baseline["lower_bound_s"] / step
        fields["efficiency_contended"] = _against(baseline, "contended_bound_s", step)
        fields["efficiency_combined"] = _against(baseline, "combined_bound_s", step)
        fields["overlap_ratio"], fields["exposed_comm_s"], method = overlap_ratio(
            baseline["comm_s"], baseline["compute_s"], step, rep["bubble_s"])
        measured = rep["bubble_s"] is not None and fields["overlap_ratio"] is not None
        fields["overlap_method"] = method + (f" ({rep['bubble_method']})" if measured else "")
    failed = [e["reason"] for _, _, e, _ in runs if e["status"] == "failed"]
    entry = {**rep, **fields, "rounds": rounds, "rerun_steal": reruns or None}
    if failed:
        entry["reason"] = f"{len(failed)} of {len(runs)} rounds failed: {failed[0]}"
    return entry


def round_plan(stats: Any) -> dict[str, Any] | None:
    """What a ``planned`` round ran (:data:`ROUND_PLAN_KEYS`), from its ``stats["plan_file"]``;
    None for other strategies. Rounds that ran different plans tell a slow plan from a slow round."""
    info = stats.get("plan_file") if isinstance(stats, dict) else None
    if not isinstance(info, dict):
        return None
    predicted = info.get("predicted") or {}
    return {"digest": info.get("digest"), "predicted_step_s": predicted.get("step_time_s"),
            "groups": info.get("groups"), "pieces": info.get("pieces"), "credit_bytes": info.get("credit_bytes"),
            "algorithms": info.get("algorithms"), "order": info.get("order"), "plan_s": info.get("plan_s"),
            # the cached profile's compute against this run's baseline, which the plan was scaled to (None: as cached)
            "profile_drift": info.get("profile_drift"),
            # "reducer": the plan named DDP's engine with buckets of bucket_bytes (older reports: None, commsched's)
            "engine": info.get("engine"), "bucket_bytes": info.get("bucket_bytes"),
            # planned+order=<order>: the order the planner chose, and the digest of its plan (None: not forced)
            "planner_order": (predicted.get("order_forced") or {}).get("planner_order"),
            "planner_digest": (predicted.get("order_forced") or {}).get("planner_digest")}


def round_tuner(stats: Any) -> dict[str, Any] | None:
    """What an ``auto`` round's tuner kept (:data:`ROUND_TUNER_KEYS`): the setting, its score (after
    the final race: the race's fresh median), the samples, the last verdict, and every sample of the
    round as ``[setting, median_s, spread_s, verdict]`` (why a round kept what it kept: only the
    representative round keeps its whole ``stats``), and the setting the race favoured (or None) with
    ``favoured_by`` "model" (the cost model's pick) or "safe" (DDP's engine where the model picks nothing);
    None for other strategies."""
    tuner = stats.get("tuner") if isinstance(stats, dict) else None
    if not isinstance(tuner, dict) or not tuner.get("incumbent"):
        return None
    history = tuner.get("history") or []
    samples = [[Settings.from_dict(h["settings"]).describe() if h.get("settings") else None, h.get("median_s"),
                h.get("spread_s"), h.get("verdict")] for h in history]
    # the setting the final race favoured: the model's pick, else (since the forty-fourth session) the safe one
    raced = next((h["race_favoured"] for h in reversed(history) if h.get("race_favoured")), None)
    favoured = raced or tuner.get("favoured")
    by = None if not favoured else "model" if favoured == tuner.get("favoured") else "safe"
    return {"kept": Settings.from_dict(tuner["incumbent"]).describe(), "score_s": tuner.get("incumbent_median_s"),
            "samples": tuner.get("samples"), "verdict": history[-1].get("verdict") if history else None,
            "history": samples, "favoured": Settings.from_dict(favoured).describe() if favoured else None,
            "favoured_by": by}


def _cpu_fields(ranks: list[dict]) -> dict[str, Any]:
    use = cpu_use(ranks, "cpu")
    busy = use["cpu_busy"]
    return {"cpu_busy": busy, "workers_cpu_busy": use["workers_busy"], "cpu_steal": use["steal"],
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


#: How each number of ``breakdown`` is measured (docs/bench.md, "Where the time goes").
BREAKDOWN_HOW = {
    "step_s": "median step time: start of one step to the start of the next (the last one ends when "
              "synchronize() returns)",
    "forward_s": "wall time of zero_grad() + forward + loss on the training thread (perf_counter)",
    "forward_compute_s": "forward_s - forward_wait_s - apply_in_forward_s, per step",
    "forward_wait_s": "commsched: the bubble of opt.stats() (time the forward pre-hooks blocked on "
                      "communication; step() never waits under cross_iteration); commsched on the "
                      "synchronous path (sync, cross_iteration=False) and others: 0 (their forward does not "
                      "wait on communication; the synchronous path waits in step())",
    "apply_in_forward_s": "optimizer step() calls inside the forward (commsched applies each layer in its "
                          "pre-hook), timed by torch's global optimizer step hooks, innermost calls only",
    "backward_s": "wall time of loss.backward() (DDP: includes waiting for its buckets; commsched: "
                  "includes the gradient hooks and submit())",
    "submit_s": "commsched: time the training thread spent in Scheduler.submit (called by the gradient "
                "hooks in backward), a timing wrapper on this run's scheduler object; others: null",
    "step_call_s": "wall time of the strategy's step() call",
    "step_wait_s": "step_call_s - the optimizer apply inside it: Horovod's wait for its all-reduces, "
                   "allreduce's flat all-reduce; ~0 for DDP and commsched",
    "optimizer_apply_s": "all optimizer step() calls of the step wherever they ran (global optimizer step "
                         "hooks, innermost calls, not commsched's own DistributedOptimizer.step wrapper)",
    "other_s": "step_s - forward_s - backward_s - step_call_s: the loop itself (progress file) and, in the "
               "last step only, the final synchronize() (not under --interleave: its last step ends where the "
               "trail step starts)",
    "final_sync_s": "wall time of synchronize() after the last measured step (commsched: the last step's "
                    "communication still in flight, and its updates; --interleave: after the trail step, "
                    "outside the measured steps)",
    "sched_cpu_s": "commsched: CPU seconds per step of its own threads (dispatch, complete, publish or "
                   "order; /proc/self/task/<tid>/schedstat over the measured steps / steps); the complete "
                   "thread's share includes the division of each reduced tensor by the world size, the dispatch "
                   "thread's the engine's launch of each all-reduce. Plus 'callback': the piece completions "
                   "run on the engine's (gloo's) threads (Scheduler.stats()['callback_cpu_s']), which with "
                   "direct_start also launch the next pieces there. Does not include submit_s (training thread)",
    "sched_cpu_per_piece_s": "sched_cpu_s x steps / pieces started in the measured steps",
    "sched_engine_cpu_s": "the part of sched_cpu_s that is the engine's and the plugin's work, not scheduling: "
                          "launch (backend.start() on the dispatch thread or, with direct_start, on the "
                          "engine's completion thread: the all-reduce's launch) and "
                          "on_done (the completion thread inside the plugin's callback: the division by the "
                          "world size), on_piece (the engine's thread inside the plugin's callback per landed "
                          "piece: its range's division); time.thread_time() around each, "
                          "Scheduler.stats()['engine_cpu_s']",
    "sched_own_cpu_per_piece_s": "(sched_cpu_s - launch - on_done - on_piece) x steps / pieces: the scheduler's "
                                 "own CPU per piece on its threads and in the engine's completions (deciding, "
                                 "waking, bookkeeping)",
    "sched_cpu_by_thread_s": "sched_cpu_s by thread",
    "decision_latency": "leader/follower orderings: per piece of the last recorded steps, rank 0's decision "
                        "(Scheduler.stats()['issue_times'], time.time() when rank 0 started it) to the "
                        "follower's issue (the same, on the follower). The ranks run on one machine, so "
                        "time.time() is one clock. data_wait_s: the follower's gradient was not ready yet "
                        "(ready_at, its submit time, after rank 0's decision); control_s = issue - "
                        "max(decision, ready): the decision's trip through the store plus the follower's "
                        "dispatch and credit. static: after step 0 no decision travels: it is the issue skew. "
                        "With decide_ahead (the default) the rest of an ended step was published before rank 0 "
                        "started its pieces, so there it is the issue skew too, and negative where the follower "
                        "started a piece first",
    "decisions_ahead": "leader/follower orderings, rank 0's Scheduler.stats() over the whole run: pieces started, "
                       "the share published ahead of their start (decide_ahead: the rest of an ended step at "
                       "once), and pieces per published batch",
    "slowest": "each top-level number is the largest per-rank median (per_rank holds each rank's medians)",
}


def _med(values: Sequence[float]) -> float | None:
    return median(list(values)) if values else None


def _rank_breakdown(r: dict, commsched: bool) -> dict[str, Any]:
    """One rank's per-step medians (see :data:`BREAKDOWN_HOW`)."""
    steps = r.get("step_times_s") or []
    n = len(steps)
    fwd, bwd, call = r.get("forward_s") or [], r.get("backward_s") or [], r.get("step_call_s") or []
    apply = r.get("apply_s") or {}
    zero = [0.0] * n
    a_fwd = (apply.get("forward") or zero)[:n]
    a_bwd = (apply.get("backward") or zero)[:n]
    a_step = (apply.get("step") or zero)[:n]
    bubbles = r.get("bubble_s") if commsched else None
    # the synchronous path (cross_iteration=False: ``sync``, or ``auto`` settled on it) waits in step(),
    # inside step_call_s, never in the forward
    synchronous = (r.get("stats") or {}).get("cross_iteration") is False
    wait = bubbles[-n:] if bubbles and len(bubbles) >= n and not synchronous else zero
    if not (len(fwd) == len(bwd) == len(call) == n and len(a_fwd) == len(a_step) == n):
        return {}
    out: dict[str, Any] = {
        "step_s": _med(steps),
        "forward_s": _med(fwd),
        "forward_compute_s": _med([f - w - a for f, w, a in zip(fwd, wait, a_fwd, strict=True)]),
        "forward_wait_s": _med(wait),
        "apply_in_forward_s": _med(a_fwd),
        "backward_s": _med(bwd),
        "submit_s": _med(r["submit_s"]) if r.get("submit_s") else None,
        "step_call_s": _med(call),
        "step_wait_s": _med([c - a for c, a in zip(call, a_step, strict=True)]),
        "optimizer_apply_s": _med([a + b + c for a, b, c in zip(a_fwd, a_bwd, a_step, strict=True)]),
        "other_s": _med([s - f - b - c for s, f, b, c in zip(steps, fwd, bwd, call, strict=True)]),
        "final_sync_s": r.get("final_sync_s"),
        "sched_cpu_s": None, "sched_cpu_per_piece_s": None, "sched_cpu_by_thread_s": None,
        "sched_engine_cpu_s": None, "sched_own_cpu_per_piece_s": None,
    }
    threads = r.get("sched_thread_cpu_s")
    if threads is not None and n:
        total = sum(threads.values())
        out["sched_cpu_s"] = total / n
        out["sched_cpu_by_thread_s"] = {k: v / n for k, v in sorted(threads.items())}
        pieces = r.get("measured_pieces")
        out["sched_cpu_per_piece_s"] = total / pieces if pieces else None
        engine = r.get("sched_engine_cpu_s")
        if isinstance(engine, dict):
            out["sched_engine_cpu_s"] = {k: v / n for k, v in sorted(engine.items())}
            if pieces:
                out["sched_own_cpu_per_piece_s"] = max(0.0, total - sum(engine.values())) / pieces
    return out


def decision_latency(leader: dict, followers: Sequence[dict]) -> dict[str, Any] | None:
    """From rank 0's and the followers' ``Scheduler.stats()`` (``per_step`` orders and
    ``issue_times``): per piece, the seconds from rank 0's decision to a follower's issue,
    split into ``data_wait_s`` (the follower's gradient was not ready yet) and ``control_s``
    (decided and ready, not yet issued); p50/p95/max of each over all pieces and followers.
    ``None`` when the stats carry no issue times."""
    def steps_of(stats: dict) -> dict[str, tuple[list, dict]]:
        sched = stats.get("scheduler", stats) if isinstance(stats, dict) else {}
        orders, times = sched.get("per_step") or {}, sched.get("issue_times") or {}
        return {str(k): (orders[k]["order"], times[t])
                for k in orders for t in times if str(t) == str(k)}

    lead = steps_of(leader)
    lat: list[float] = []
    data: list[float] = []
    ctrl: list[float] = []
    used: set[str] = set()
    for follower in followers:
        for step, (order, times) in steps_of(follower).items():
            if step not in lead:
                continue
            decided = dict(zip(lead[step][0], lead[step][1]["issued_at"], strict=False))
            for name, issued, ready in zip(order, times["issued_at"], times["ready_at"], strict=False):
                if name not in decided:
                    continue
                used.add(step)
                d = decided[name]
                lat.append(issued - d)
                data.append(max(0.0, ready - d))
                ctrl.append(issued - max(d, ready))
    if not lat:
        return None

    def q(values: list[float]) -> dict[str, float | None]:
        return {"p50": quantile(values, 0.5), "p95": quantile(values, 0.95), "max": max(values)}

    return {"pieces": len(lat), "steps": sorted(used, key=int), "latency_s": q(lat), "data_wait_s": q(data),
            "control_s": q(ctrl)}


def decisions_ahead(leader: dict) -> dict[str, Any] | None:
    """From rank 0's ``Scheduler.stats()`` over the whole run: the pieces it started, the share of
    them published ahead (``SchedulerConfig.decide_ahead``) and the decisions per published batch.
    ``None`` when the stats lack the counts (an older worker)."""
    sched = leader.get("scheduler", leader) if isinstance(leader, dict) else {}
    pieces, ahead, batches = (sched.get(k) for k in ("pieces", "decided_ahead", "published_batches"))
    if not isinstance(pieces, int) or not isinstance(ahead, int) or not isinstance(batches, int):
        return None
    return {"pieces": pieces, "ahead_share": ahead / pieces if pieces else 0.0,
            "pieces_per_batch": pieces / batches if batches else None}


def breakdown(phase: Any) -> dict[str, Any] | None:
    """Where one strategy's step time goes (torch's workload benchmark): the keys of
    :data:`BREAKDOWN_HOW` for the slowest rank (the largest per-rank median of each), each
    rank's medians in ``per_rank``, the measurement of each in ``how``. ``None`` when the
    workers recorded none (an older worker, or a framework without these timers)."""
    if phase.status != "ok" or not phase.ranks or "apply_s" not in phase.ranks[0]:
        return None
    commsched = _is_commsched(phase.name)
    per_rank = [_rank_breakdown(r, commsched) for r in phase.ranks]
    if not all(per_rank):
        return None
    out: dict[str, Any] = {}
    for key in per_rank[0]:
        values = [p[key] for p in per_rank if isinstance(p.get(key), (int, float))]
        out[key] = max(values) if values else None
    threads = [p["sched_cpu_by_thread_s"] for p in per_rank if p.get("sched_cpu_by_thread_s")]
    out["sched_cpu_by_thread_s"] = ({k: max(t.get(k, 0.0) for t in threads) for t in threads for k in t}
                                    if threads else None)
    engines = [p["sched_engine_cpu_s"] for p in per_rank if p.get("sched_engine_cpu_s")]
    out["sched_engine_cpu_s"] = ({k: max(t.get(k, 0.0) for t in engines) for t in engines for k in t}
                                 if engines else None)
    stats = [r.get("stats") or {} for r in phase.ranks]
    mode = (stats[0].get("scheduler") or {}).get("mode") if isinstance(stats[0], dict) else None
    out["decision_latency"] = decision_latency(stats[0], stats[1:]) if mode == "leader" else None
    out["decisions_ahead"] = decisions_ahead(stats[0]) if mode == "leader" else None
    out["per_rank"] = per_rank
    out["how"] = dict(BREAKDOWN_HOW)
    return out


def _is_commsched(name: str) -> bool:
    from commsched.bench.spec import parse_strategies

    try:
        return parse_strategies(name)[0].is_commsched
    except ValueError:
        return False


def build_report(config: dict, emulation: str, emulation_note: str, workload: dict,
                 baseline_phase: Any, phases: list[Any], framework: str = "torch",
                 calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole JSON document (docs/bench.md) from the runner's phases (torch's workload benchmark).

    ``phases``: per strategy, its phase, or a list of its phases, one per round (``--rounds``).

    ``calibration``: keyword arguments of :func:`calibration_block` (``expected`` the regime the
    workload is named for, what ``--calibrate`` did); the measured regime comes from the baseline."""
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
    results = _without_uncovered([summarize_rounds(p, baseline, samples) if isinstance(p, (list, tuple))
                                  else summarize_strategy(p, baseline, samples) for p in phases], config)
    calib = calibration_block(baseline=baseline, **(calibration or {"expected": None}))
    if calib["matches"] is False:
        warnings.append(
            f"workload {workload.get('name')!r} is meant to be {calib['expected_regime']} but measured "
            f"{calib['measured_regime']} here (compute / comm = {calib['compute_over_comm']:.2f}; balanced is "
            f"{1 / BALANCED_BAND:.2f}..{BALANCED_BAND:.2f}): use --calibrate, or --batch-size, to put it in "
            "its regime on this machine")
    return assemble_report(framework, config, emulation, emulation_note, workload, baseline, results, warnings,
                           calibration=calib)


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
                    baseline: dict | None, results: list[dict], warnings: list[str] | None = None,
                    calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """The document from finished entries: speedups against the framework's
    baseline strategy, warnings, and every key of :data:`REPORT_KEYS` (``calibration``:
    :func:`calibration_block`, or ``None`` where the benchmark has none)."""
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
            paired = _paired_speedups(ref, r)
            if paired:
                r["speedup_vs_baseline"] = median(paired)
        if r.get("rounds") and any(x["status"] == "failed" for x in r["rounds"]):
            warnings.append(f"{r['strategy']}: {r['reason']}")
        if r.get("rerun_steal") and not r.get("rounds"):  # with rounds, the per-round section lists them
            warnings.append(f"{r['strategy']}: run again because the hypervisor took CPU (--max-steal): the "
                            f"discarded runs lost {', '.join(f'{v:.1%}' for v in r['rerun_steal'])}, the one "
                            f"kept {_fmt(r['cpu_steal'], '.1%')}")
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
        "calibration": calibration,
        "results": results,
        "warnings": warnings,
    }


def _paired_speedups(ref: dict, entry: dict) -> list[float]:
    """Each round's ``ref`` step / ``entry`` step, both measured in that round; written into
    ``entry["rounds"]``. Empty without rounds on both sides."""
    if not ref.get("rounds") or not entry.get("rounds"):
        return []
    ref_by_round = {x["round"]: x["step_time_s"] for x in ref["rounds"] if x["status"] == "ok"}
    paired = []
    for x in entry["rounds"]:
        if x["status"] == "ok" and ref_by_round.get(x["round"]):
            x["speedup_vs_baseline"] = ref_by_round[x["round"]] / x["step_time_s"]
            paired.append(x["speedup_vs_baseline"])
    return paired


def _fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _link(report: dict) -> str:
    """What the links were, e.g. "1gbit (netns)" or "unshaped (loopback)"."""
    rate = report["config"]["bandwidth"] if report["emulation"] == "netns" else None
    return f"{rate or 'unshaped'} ({report['emulation']})"


#: The table's header, the same for every framework (the baseline strategy is named above it).
TABLE_HEADER = ("| strategy | step s (median) | IQR s | samples/s | speedup vs baseline (ceiling) "
                "| bubble s | overlap | efficiency (contended; combined) | CPU busy (workers) | pieces/step |")


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
                f"{_fmt(base['compute_under_comm_s'])} s{_contention_note(base)}")
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
        contended = ("" if base.get("contended_bound_s") is None else
                     f"; with compute under a concurrent all-reduce {base['contended_bound_s']:.3f} s (the "
                     "contended bound, the efficiency in parentheses)")
        lines.append(f"- lower bound max(compute, comm) {base['lower_bound_s']:.3f} s{contended}; no overlap "
                     f"{base['no_overlap_s']:.3f} s{ceiling}")
        if base.get("dependency_bound_s") is not None:
            lines.append(_dependency_line(base))
    cal = report.get("calibration")
    if cal:
        lines.append(_calibration_line(cal))
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
            f"| {_overlap_cell(r)} | {_efficiency_cell(r)} | {busy} "
            f"| {_fmt(r['pieces_per_step'], '.0f')} |"
        )
    blocks = ((report.get("config") or {}).get("extra") or {}).get("interleave")
    lines += rounds_table(report["results"], interleaved=bool(blocks))
    lines += breakdown_table(report["results"])
    if report["warnings"]:
        lines += ["", "Warnings:"] + [f"- {w}" for w in report["warnings"]]
    return "\n".join(lines)


def _dependency_line(base: dict) -> str:
    """The header line of the dependency bound and the combined one (module docstring)."""
    layer = base.get("dependency_layer")
    adds = base["dependency_bound_s"] / base["lower_bound_s"] - 1 if base.get("lower_bound_s") else 0.0
    why = (f"the next forward needs every layer up to {layer} reduced before it reaches {layer}, and none of "
           f"their gradients is ready before {layer}'s (+{adds:.0%} on max(compute, comm))"
           if layer is not None and adds >= 0.01 else
           "no layer's dependency adds 1 % to max(compute, comm) here")
    combined = base.get("combined_bound_s")
    return (f"- dependency bound {base['dependency_bound_s']:.3f} s: {why} (docs/bench.md, \"The dependency "
            "bound\")" + ("" if combined is None else
                          f"; the larger of it and the contended bound {combined:.3f} s (the efficiency after "
                          "the semicolon)"))


def _efficiency_cell(r: dict) -> str:
    """``efficiency`` and, in parentheses, ``efficiency_contended`` and ``efficiency_combined``
    where the baseline has them."""
    cell = _fmt(r["efficiency"], ".2f")
    if r.get("efficiency_contended") is None:
        return cell
    combined = "" if r.get("efficiency_combined") is None else f"; {r['efficiency_combined']:.2f}"
    return f"{cell} ({r['efficiency_contended']:.2f}{combined})"


def _overlap_cell(r: dict) -> str:
    if r["overlap_ratio"] is None and (r.get("overlap_method") or "").startswith("n/a"):
        return "n/a"
    return _fmt(r["overlap_ratio"], ".2f")


def _calibration_line(cal: dict) -> str:
    ratio = _fmt(cal["compute_over_comm"], ".2f")
    line = (f"- regime: meant {cal['expected_regime'] or '-'}, measured {cal['measured_regime'] or '-'} "
            f"(compute / comm {ratio})")
    if cal["calibrated"]:
        tried = ", ".join(f"batch {t['batch_size']}: {t['compute_s'] / t['comm_s']:.2f}" for t in cal["trials"])
        line += (f"; --calibrate chose batch {cal['batch_size']} (default {cal['default_batch_size']}) for "
                 f"compute / comm {cal['target_compute_over_comm']} (tried {tried})")
    return line


def rounds_table(results: list[dict], interleaved: bool = False) -> list[str]:
    """With ``--rounds``: each strategy's median step and paired speedup per round, and the CPU
    steal of its slowest round (a round that ran on a stolen CPU says so). ``interleaved``
    (``--interleave``): the rounds are the blocks of one phase, and the table says so."""
    with_rounds = [r for r in results if r.get("rounds")]
    if not with_rounds:
        return []
    count = max(len(r["rounds"]) for r in with_rounds)
    head = " | ".join(f"round {i + 1}" for i in range(count))
    what = ("Per block of the one interleaved phase (each block reported as a round: median step s, speedup "
            "within the block, position in the block's order; the table above: median of the blocks, paired "
            "speedup):") if interleaved else (
            "Per round (median step s, speedup within the round, position in the round's order; "
            "the table above: median of the rounds, paired speedup):")
    lines = ["", what, "",
             f"| strategy | {head} | speedup min..max | max CPU steal |",
             "|---|" + "---:|" * (count + 2)]
    for r in with_rounds:
        cells = []
        for x in sorted(r["rounds"], key=lambda x: x["round"]):
            if x["status"] != "ok":
                cells.append(x["status"])
                continue
            cells.append(f"{x['step_time_s']:.3f} ({_fmt(x['speedup_vs_baseline'], '.2f', 'x')}, #{x['position']})")
        speedups = [x["speedup_vs_baseline"] for x in r["rounds"] if x["speedup_vs_baseline"] is not None]
        span = f"{min(speedups):.2f}..{max(speedups):.2f}x" if speedups else "-"
        steal = max((x["cpu_steal"] for x in r["rounds"] if x["cpu_steal"] is not None), default=None)
        lines.append(f"| {r['strategy']} | " + " | ".join(cells) + f" | {span} | {_fmt(steal, '.3f')} |")
    def rounds_with(key: str) -> list[tuple[str, dict]]:  # (strategy, round) of the rounds that have ``key``
        return [(r["strategy"], x) for r in with_rounds for x in sorted(r["rounds"], key=lambda x: x["round"])
                if x.get(key)]

    plans = rounds_with("plan")
    if plans:
        lines += ["", "Plans per round (the digest tells whether rounds ran the same plan):", ""]
        for name, x in plans:
            plan = x["plan"]
            credit = plan["credit_bytes"] / (1 << 20) if plan["credit_bytes"] is not None else None
            lines.append(f"- {name} round {x['round']}: plan {str(plan['digest'])[:12]}, predicted "
                         f"{_fmt(plan['predicted_step_s'], '.3f')} s, measured {_fmt(x['step_time_s'], '.3f')} s; "
                         f"{plan['groups']} groups, {plan['pieces']} pieces, credit {_fmt(credit, '.2f')} MiB, "
                         f"{'/'.join(plan['algorithms'] or [])}"
                         + (f", {plan['order']} order" if plan.get("order") else "")
                         + (f" (forced; the planner's: {plan['planner_order']}, plan "
                            f"{str(plan.get('planner_digest'))[:12]})" if plan.get("planner_order") else "")
                         + (f", engine: DDP's reducer, buckets {plan['bucket_bytes'] / (1 << 20):g} MiB"
                            if plan.get("engine") == "reducer" and plan.get("bucket_bytes") else "")
                         + (f"; profile scaled {plan['profile_drift']:+.1%} to this run's compute"
                            if plan.get("profile_drift") is not None else ""))
    tuned = rounds_with("tuner")
    if tuned:
        lines += ["", "What the tuner kept per round (its score against the round's measured steps):", ""]
        for name, x in tuned:
            t = x["tuner"]
            lines.append(f"- {name} round {x['round']}: {t['kept']}, scored {_fmt(t['score_s'], '.3f')} s, measured "
                         f"{_fmt(x['step_time_s'], '.3f')} s; {t['samples']} samples, last verdict {t['verdict']}"
                         + ((f"; the model's pick: {t['favoured']}" if t.get("favoured_by") != "safe" else
                             f"; favoured as the safe choice: {t['favoured']}") if t.get("favoured") else ""))
    reruns = rounds_with("rerun_steal")
    if reruns:
        lines += ["", "Rounds run again because the hypervisor took CPU (--max-steal; the steal of each run "
                      "discarded, then of the one kept):", ""]
        for name, x in reruns:
            lines.append(f"- {name} round {x['round']}: " + ", ".join(f"{v:.3f}" for v in x["rerun_steal"])
                         + f" discarded; kept {_fmt(x['cpu_steal'], '.3f')}")
    return lines


#: The second table: where each strategy's step goes, in ms (slowest rank; docs/bench.md).
BREAKDOWN_HEADER = ("| strategy | step | fwd compute | fwd wait | apply | backward (submit) | step() (wait) "
                    "| other | final sync | sched CPU/step (/piece; own) | decision→issue p50/p95 (control p95; "
                    "share decided ahead) |")


def breakdown_table(results: list[dict]) -> list[str]:
    """The breakdown of every strategy that has one, as markdown lines (empty when none has)."""
    rows = [r for r in results if r["status"] == "ok" and r.get("breakdown")]
    if not rows:
        return []

    def ms(value: float | None, spec: str = ".1f") -> str:
        return "-" if value is None else f"{value * 1e3:{spec}}"

    lines = ["", "Where the time goes (ms per step, median, slowest rank; how each is measured: "
             "breakdown.how in the JSON):", "", BREAKDOWN_HEADER, "|---|" + "---:|" * 10]
    for r in rows:
        b = r["breakdown"]
        sub = f" ({ms(b['submit_s'])})" if b.get("submit_s") is not None else ""
        cpu = "-"
        if b.get("sched_cpu_s") is not None:
            per_piece = b.get("sched_cpu_per_piece_s")
            own = b.get("sched_own_cpu_per_piece_s")
            cpu = ms(b["sched_cpu_s"], ".2f") + (f" ({per_piece * 1e6:.0f} µs" if per_piece else "") + (
                f"; own {own * 1e6:.0f} µs" if per_piece and own is not None else "") + (")" if per_piece else "")
        lat = b.get("decision_latency")
        dec = "-" if not lat else (f"{ms(lat['latency_s']['p50'], '.2f')}/{ms(lat['latency_s']['p95'], '.2f')} "
                                   f"({ms(lat['control_s']['p95'], '.2f')})")
        ahead = b.get("decisions_ahead")
        if lat and ahead:
            dec += f"; {ahead['ahead_share']:.0%} ahead"
        lines.append(
            f"| {r['strategy']} | {ms(b['step_s'])} | {ms(b['forward_compute_s'])} | {ms(b['forward_wait_s'])} "
            f"| {ms(b['optimizer_apply_s'])} | {ms(b['backward_s'])}{sub} "
            f"| {ms(b['step_call_s'])} ({ms(b['step_wait_s'])}) | {ms(b['other_s'])} | {ms(b['final_sync_s'])} "
            f"| {cpu} | {dec} |")
    return lines


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
