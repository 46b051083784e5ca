"""A short human summary of a training run with commsched, and what the cost model expected.

Framework-free: a plugin passes what it measured (its stats and, when it can, a
:class:`~commsched.costmodel.profile.Profile` of the recorded steps); with a
:class:`~commsched.costmodel.topology.Topology` the summary adds the communication
the network should take, the overlap that implies, and the simulator's expected step.
"""

from __future__ import annotations

from typing import Any

from commsched.costmodel.collectives import allreduce_s
from commsched.costmodel.profile import Profile
from commsched.costmodel.simulator import SimSettings, simulate
from commsched.costmodel.topology import Topology

__all__ = ["format_report", "training_report"]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def training_report(stats: dict[str, Any], *, settings: dict[str, Any], profile: Profile | None = None,
                    topology: Topology | None = None, last: int = 20) -> dict[str, Any]:
    """The numbers of the summary (see :func:`format_report` for the text).

    ``stats``: the plugin's ``stats()`` (``steps``, ``bubble_s`` per step, ``scheduler`` with
    ``per_step`` bytes and pieces). ``settings``: what is in use (ordering, piece size, credit, ...).
    """
    bubbles = list(stats.get("bubble_s", []))[-last:]
    per_step = stats.get("scheduler", {}).get("per_step", {})
    done = sorted(per_step)[:-1] or sorted(per_step)  # the newest step may still be communicating
    bytes_per_step = _mean([per_step[s]["bytes"] for s in done])
    pieces_per_step = _mean([per_step[s]["pieces"] for s in done])
    step_s = (profile.meta.get("step_s") if profile is not None else None)
    out: dict[str, Any] = {
        "steps": stats.get("steps"), "exposed_comm_s": _mean(bubbles), "bytes_per_step": bytes_per_step,
        "pieces_per_step": pieces_per_step, "step_s": step_s, "settings": dict(settings),
        "goodput_bytes_s": (bytes_per_step / step_s) if bytes_per_step and step_s else None,
        "expected_comm_s": None, "overlap_ratio": None, "expected_step_s": None, "expected_exposed_s": None,
    }
    if topology is not None and bytes_per_step:
        comm = allreduce_s(topology, bytes_per_step, "ring")
        out["expected_comm_s"] = comm
        if out["exposed_comm_s"] is not None and comm > 0:
            out["overlap_ratio"] = min(1.0, max(0.0, 1.0 - out["exposed_comm_s"] / comm))
        if profile is not None:
            sim_settings = SimSettings(partition_bytes=int(settings.get("partition_bytes", 4 << 20)),
                                       credit_bytes=int(settings.get("credit_bytes", 16 << 20)),
                                       fusion_bytes=int(settings.get("fusion_bytes", 0)))  # 0: a plugin that fuses none
            ordering = settings.get("ordering", "dynamic")
            name = ordering if ordering in ("fifo", "dynamic", "static") else "dynamic"
            result = simulate(profile, topology, name, sim_settings)
            out["expected_step_s"] = result.step_time_s
            out["expected_exposed_s"] = result.exposed_comm_s
    return out


def format_report(numbers: dict[str, Any]) -> str:
    """The summary as a few lines of text."""
    def fmt(value: Any, spec: str, unit: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{unit}"

    s = numbers["settings"]
    goodput = numbers["goodput_bytes_s"] / 1e6 if numbers["goodput_bytes_s"] else None
    lines = [f"commsched after {numbers['steps']} steps: " + ", ".join(f"{k}={v}" for k, v in s.items()),
             f"  exposed communication per step: {fmt(numbers['exposed_comm_s'], '.4f', ' s')}"
             f" (time the forward or step() waited on the network; last steps)",
             f"  communicated per step: {fmt((numbers['bytes_per_step'] or 0) / 1e6, '.2f', ' MB')} in "
             f"{fmt(numbers['pieces_per_step'], '.0f')} pieces; step {fmt(numbers['step_s'], '.4f', ' s')}; "
             f"goodput {fmt(goodput, '.1f', ' MB/s')} (bytes per step / step time)"]
    if numbers["expected_comm_s"] is not None:
        lines.append(f"  the network should take {numbers['expected_comm_s']:.4f} s per step for these bytes: "
                     f"{fmt(numbers['overlap_ratio'], '.0%')} of it hidden behind compute")
    if numbers["expected_step_s"] is not None:
        lines.append(f"  the simulator expected a step of {numbers['expected_step_s']:.4f} s with "
                     f"{numbers['expected_exposed_s']:.4f} s exposed (measured {fmt(numbers['step_s'], '.4f', ' s')})")
    else:
        lines.append("  (pass topology=... to compare with the cost model: commsched probe writes one)")
    return "\n".join(lines)
