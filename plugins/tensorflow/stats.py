"""``stats()`` and ``report()`` for TensorFlow: what the graph measured of commsched's pieces.

One *step* here is one run of one traced reduction (one ``apply_gradients`` of a
:func:`~commsched.plugins.tensorflow.DistributedOptimizer`, or one ``gradient()`` of a
:func:`~commsched.plugins.tensorflow.DistributedGradientTape`). Its numbers come from the
stamps the graph writes (:mod:`commsched.plugins.tensorflow.measure`):

* bytes and pieces: the traced plan's, counted once per run;
* ``comm_s``: time at least one piece was in flight (union of issue→done);
* ``exposed_comm_s``: from the last gradient ready to the last piece reduced, the time the
  step waits on the network after backward. Measurable for separate compiled steps,
  whose call returns only when every piece landed. With :func:`unroll`, the next
  step's forward may hide part of it; how much is *not* measured;
* ``compute_s``: from the start of the step's function to the last gradient;
* effective bandwidth: bytes / ``comm_s`` (what the pieces achieved while on the wire).

The first run of every trace is left out of the times (it sets up the collective group
and resolves each instance key through worker 0). With a
:class:`~commsched.costmodel.topology.Topology` the report adds what the network should
take for these bytes, and what the simulator expects of a step with the measured
compute (a profile inferred from the stamps; see :func:`inferred_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from commsched.plugins.tensorflow.measure import Recorder, Run

__all__ = ["TraceRecord", "format_report", "inferred_profile", "observed_readiness", "reduction_stats"]


@dataclass(frozen=True)
class TraceRecord:
    """One traced reduction: its plan (:class:`commsched.replay.Plan`), its recorder, the
    settings it was traced with (a dict: ordering, partition_bytes, credit_bytes, slots, ...)
    and the key its reducer finds it by (the plan's order, slots and world size)."""

    plan: Any
    recorder: Recorder
    settings: dict
    key: tuple = ()
    #: per tensor of the plan (``PlannedPiece.tensor``), the gradient names it holds (one, or a fused group's)
    members: tuple = ()


def _measured(records: Iterable[TraceRecord]) -> list[tuple[TraceRecord, Run]]:
    out = []
    for record in records:
        if record.recorder.unmeasured:
            continue
        runs = record.recorder.runs()
        skip_first = record.recorder.count <= record.recorder.capacity  # the warm-up run is still in the ring
        out.extend((record, run) for run in (runs[1:] if skip_first else runs))
    return out


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def reduction_stats(records: Iterable[TraceRecord]) -> dict[str, Any]:
    """The numbers of :func:`format_report` (see the module docstring); times in seconds, per step."""
    records = list(records)
    counts = [r.recorder.count for r in records]
    steps = sum(counts)
    nbytes = sum(c * sum(p.nbytes for p in r.plan.pieces) for r, c in zip(records, counts, strict=True))
    npieces = sum(c * len(r.plan.pieces) for r, c in zip(records, counts, strict=True))
    measured = _measured(records)
    comm = [run.comm_s for _, run in measured]
    exposed = [run.tail_s for _, run in measured]
    compute = [run.compute_s for _, run in measured]
    measured_bytes = sum(sum(p.nbytes for p in r.plan.pieces) for r, _ in measured)
    out: dict[str, Any] = {
        "steps": steps, "traces": len(records),
        "bytes_per_step": nbytes / steps if steps else None, "pieces_per_step": npieces / steps if steps else None,
        "measured_steps": len(measured), "comm_s": _mean(comm), "exposed_comm_s": _mean(exposed),
        "compute_s": _mean(compute),
        "effective_bandwidth_bytes_s": measured_bytes / sum(comm) if comm and sum(comm) > 0 else None,
        "overlap_ratio": None,
    }
    if out["comm_s"]:
        out["overlap_ratio"] = min(1.0, max(0.0, 1.0 - out["exposed_comm_s"] / out["comm_s"]))
    return out


def observed_readiness(records: Iterable[TraceRecord], names: Iterable[str], min_runs: int = 2
                       ) -> dict[str, Any] | None:
    """What the graph measured of an earlier trace that reduced exactly the gradients ``names``:
    ``{"ready": {name: s}, "link_bytes_per_s": b, "runs": n}``, or None when no kept trace
    covers them with at least ``min_runs`` measured runs (the first run of a trace left out).

    ``ready``: when each gradient was ready, in seconds after the first one, the median over the
    runs (a fused group's members: the group's); ``link_bytes_per_s``: the pieces' bytes over the
    time at least one was in flight, the median over the runs (what the concurrent collectives
    achieved together). The newest matching trace wins. JSON-able, so workers can agree on one."""
    want = set(names)
    for record in reversed(list(records)):
        if record.recorder.unmeasured or not record.members:
            continue
        if {n for m in record.members for n in m} != want:
            continue
        runs = _measured([record])
        if len(runs) < min_runs:
            continue
        pieces = record.plan.pieces
        total = sum(p.nbytes for p in pieces)
        per_tensor: dict[int, list[float]] = {}
        rates = []
        for _, run in runs:
            first = float(run.ready.min())
            latest: dict[int, float] = {}
            for k, piece in enumerate(pieces):  # a tensor is ready when its last piece is
                latest[piece.tensor] = max(latest.get(piece.tensor, 0.0), float(run.ready[k]) - first)
            for t, at in latest.items():
                per_tensor.setdefault(t, []).append(at)
            if run.comm_s > 0:
                rates.append(total / run.comm_s)
        if not rates:
            continue
        ready = {name: float(np.median(per_tensor[t])) for t, group in enumerate(record.members)
                 for name in group if t in per_tensor}
        if set(ready) != want:
            continue
        return {"ready": ready, "link_bytes_per_s": float(np.median(rates)), "runs": len(runs)}
    return None


def inferred_profile(record: TraceRecord, run: Run):
    """A :class:`~commsched.costmodel.profile.Profile` of one measured run, as far as the stamps
    tell: one layer per reduced tensor in forward order, each ready when its first piece was
    ready (counted from the first gradient, taken as the start of backward), backward times
    the gaps between readiness, and the time from the step's start to the first gradient as
    forward, spread evenly over the layers (a graph has no per-layer forward stamps)."""
    from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec

    plan = record.plan
    ready: dict[int, float] = {}
    for k, piece in enumerate(plan.pieces):
        ready[piece.tensor] = min(ready.get(piece.tensor, np.inf), float(run.ready[k]))
    # forward order: by priority (a fused group of small gradients sits at its first member's place)
    priority = {p.tensor: p.priority for p in plan.pieces}
    tensors = sorted(ready, key=lambda t: (priority[t], t))
    first = min(ready.values())
    forward = max(0.0, first - run.start) / max(1, len(tensors))
    names = {p.tensor: p.name.rpartition("#")[0] or p.name for p in plan.pieces}
    sizes: dict[int, int] = {}
    elem: dict[int, int] = {}
    for piece in plan.pieces:
        sizes[piece.tensor] = max(sizes.get(piece.tensor, 0), piece.stop)
        elem[piece.tensor] = max(1, piece.nbytes // max(1, piece.stop - piece.start))
    layers = []
    # backward runs the layers in reverse: layer i's backward ends when its gradient is ready
    later_ready = first
    for i in reversed(tensors):
        backward = max(0.0, ready[i] - later_ready)
        later_ready = max(later_ready, ready[i])
        layers.append(LayerProfile(name=names[i], forward_s=forward, backward_s=backward,
                                   tensors=(TensorSpec(names[i], sizes[i], elem[i]),),
                                   ready_s=ready[i] - first))
    layers.reverse()
    return Profile(layers=tuple(layers), source="commsched TensorFlow stamps (inferred)")


def _expectation(records: list[TraceRecord], numbers: dict[str, Any], topology: Any) -> dict[str, Any]:
    from commsched.costmodel.collectives import allreduce_s
    from commsched.costmodel.simulator import SimSettings, simulate

    out: dict[str, Any] = {"expected_comm_s": None, "expected_step_s": None, "expected_exposed_s": None,
                           "expected_strategy": None}
    if not numbers["bytes_per_step"]:
        return out
    out["expected_comm_s"] = allreduce_s(topology, int(numbers["bytes_per_step"]), "ring")
    measured = _measured(records)
    if not measured:
        return out
    record, run = measured[-1]
    settings = record.settings
    ordering = settings.get("ordering", "dynamic")
    strategy = ordering if ordering in ("fifo", "dynamic", "static") else "dynamic"
    result = simulate(inferred_profile(record, run), topology, strategy,
                      SimSettings(partition_bytes=int(settings["partition_bytes"]),
                                  credit_bytes=int(settings["credit_bytes"]),
                                  fusion_bytes=int(settings["fusion_bytes"]),
                                  trace=False))
    out.update(expected_step_s=result.step_time_s, expected_exposed_s=result.exposed_comm_s,
               expected_strategy=strategy)
    return out


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.2f} kB"


def format_report(records: Iterable[TraceRecord], settings: dict[str, Any], topology: Any = None) -> str:
    """A few lines of text: what was measured, in which settings, and (with ``topology``) what the
    cost model expected. Never prints a zero for what was not measured: it says so."""
    records = list(records)
    n = reduction_stats(records)

    def fmt(value: Any, spec: str, unit: str = "") -> str:
        return "not measured" if value is None else f"{value:{spec}}{unit}"

    head = ", ".join(f"{k}={v}" for k, v in settings.items())
    lines = [f"commsched (TensorFlow) after {n['steps']} steps in {n['traces']} traced reduction(s): {head}"]
    if not n["steps"]:
        lines.append("  nothing reduced yet: no step ran, one replica (nothing to communicate), or the gradients came "
                     "already reduced from a DistributedGradientTape (commsched.plugins.tensorflow.report() covers "
                     "every reduction of the process)")
        return "\n".join(lines)
    lines.append(f"  communicated per step: {_size(n['bytes_per_step'])} in {n['pieces_per_step']:.0f} pieces")
    if n["measured_steps"]:
        bandwidth = n["effective_bandwidth_bytes_s"]
        bandwidth = None if bandwidth is None else bandwidth / 1e6
        lines += [
            f"  measured in the graph over {n['measured_steps']} step(s) (the first run of each trace left out):",
            f"    communication in flight {fmt(n['comm_s'], '.4f', ' s')} per step; effective bandwidth "
            f"{fmt(bandwidth, '.2f', ' MB/s')} (bytes / time in flight)",
            f"    exposed communication per step: {fmt(n['exposed_comm_s'], '.4f', ' s')} (last gradient ready to "
            f"last piece reduced); overlap ratio {fmt(n['overlap_ratio'], '.0%')}",
            f"    compute to the last gradient: {fmt(n['compute_s'], '.4f', ' s')} per step",
            "    not measured: how much of that exposed time the next forward hides under unroll (no stamp "
            "marks where the next step's forward waits)"]
    elif settings.get("measure") is False:
        lines.append("  times: not measured (measure=False: the graph writes no stamps)")
    else:
        lines.append("  times: not measured yet (only warm-up runs so far; each trace's first run is left out)")
    if topology is None:
        lines.append("  (pass topology=... to compare with the cost model: commsched probe writes one)")
        return "\n".join(lines)
    e = _expectation(records, n, topology)
    lines.append(f"  the network should take {fmt(e['expected_comm_s'], '.4f', ' s')} per step for these bytes "
                 f"(ring all-reduce on the topology); measured in flight {fmt(n['comm_s'], '.4f', ' s')}")
    if e["expected_step_s"] is not None:
        lines.append(f"  the simulator ({e['expected_strategy']}, on a profile inferred from the stamps; it models "
                     f"cross-iteration overlap, which TensorFlow has only with unroll) expected a step of "
                     f"{e['expected_step_s']:.4f} s with {e['expected_exposed_s']:.4f} s exposed")
    return "\n".join(lines)
