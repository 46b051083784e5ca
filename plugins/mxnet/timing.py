"""What the commsched KVStore can measure of each step, from where it sits: engine notifiers and gates.

A KVStore sees four kinds of moments, all on one monotonic clock:

* **ready** — an engine notifier fired: backward (or the copy into a push buffer) wrote a
  key's gradient. The latest ready of a step is the end of its backward;
* **landed** — every piece of a key is back and its engine gate opens: the update and the
  next forward of that key's layer may run from now on;
* **piece** — one sub-key's push was issued, and its pulled data is in place;
* **blocked** (``gate="issue"`` only) — ``pushpull`` held the Python thread until its pieces
  were issued.

From them, per step: the time the next forward's first layer waited past the end of
backward (the gate of the most urgent key: that layer cannot run before it opens), the
time communication went on after backward (an upper bound of what the next forward could
have waited), the time at least one piece was in flight, the bytes and pieces, and the
period between the ends of two backwards. What a KVStore cannot see is the next forward's
own operations (they are the user's, queued in the engine): how much of the communication
after backward those operations hid is not measurable here, and :func:`format_report`
says so instead of printing a number.

:func:`pslite_comm_s` is the α-β cost of one step's push and pull on a
:class:`~commsched.costmodel.topology.Topology`; the discrete-event simulator models
all-reduce collectives (ring, two-level), not a parameter server, so there is no
simulated step for ps-lite.

Nothing here calls MXNet, so it is tested on made-up moments, without a job.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from commsched.costmodel.profile import merged_spans

__all__ = ["StepTimes", "format_report", "pslite_comm_s"]

KEEP_STEPS = 20


@dataclass
class _Step:
    reserved: int = 0
    ready: dict[int, float] = field(default_factory=dict)  # task id -> when its data was written
    landed: dict[int, float] = field(default_factory=dict)  # task id -> when its gate opened
    priority: dict[int, int] = field(default_factory=dict)  # task id -> scheduler priority (0 = most urgent)
    spans: list[tuple[float, float]] = field(default_factory=list)
    open_pieces: int = 0
    pieces: int = 0
    nbytes: int = 0
    blocked_s: float = 0.0

    def complete(self) -> bool:
        return self.reserved > 0 and len(self.landed) == self.reserved and self.open_pieces == 0


class StepTimes:
    """The moments of the last ``keep`` steps (see the module docstring); thread-safe.

    Called from the user's thread (``reserved``, ``blocked``), engine threads (``ready``,
    ``piece_done``) and the scheduler's threads (``piece_started``, ``landed``); each call is
    a few dictionary updates under one lock and never raises into the engine.
    """

    def __init__(self, keep: int = KEEP_STEPS) -> None:
        if keep < 2:
            raise ValueError(f"keep={keep!r} must be at least 2 (a period needs two steps)")
        self._keep = keep
        self._lock = threading.Lock()
        self._steps: dict[int, _Step] = {}

    def _step(self, step: int) -> _Step:
        found = self._steps.get(step)
        if found is None:
            found = self._steps[step] = _Step()
            for old in [s for s in self._steps if s <= step - self._keep]:
                del self._steps[old]
        return found

    def reserved(self, step: int, task: int, priority: int) -> None:
        with self._lock:
            s = self._step(step)
            s.reserved += 1
            s.priority[task] = priority

    def ready(self, step: int, task: int, at: float) -> None:
        with self._lock:
            self._step(step).ready[task] = at

    def landed(self, step: int, task: int, at: float) -> None:
        with self._lock:
            self._step(step).landed[task] = at

    def piece_started(self, step: int, nbytes: int, at: float) -> int:
        """Count a piece issued at ``at``; returns the index to pass to :meth:`piece_done`."""
        with self._lock:
            s = self._step(step)
            s.pieces += 1
            s.nbytes += int(nbytes)
            s.open_pieces += 1
            s.spans.append((at, at))
            return len(s.spans) - 1

    def piece_done(self, step: int, index: int, at: float) -> None:
        with self._lock:
            s = self._steps.get(step)
            if s is None:  # older than the steps kept
                return
            start, _ = s.spans[index]
            s.spans[index] = (start, max(start, at))
            s.open_pieces -= 1

    def blocked(self, step: int, seconds: float) -> None:
        with self._lock:
            self._step(step).blocked_s += max(0.0, seconds)

    def summary(self, gate_mode: str) -> dict[str, Any]:
        """Means over the complete steps kept, step 0 left out when a later one is complete (it
        includes the initial broadcast). ``None`` where nothing was measured."""
        with self._lock:
            steps = {n: s for n, s in self._steps.items() if s.complete()}
            done = sorted(steps)
            used = [n for n in done if n > 0] or done
            rows = []
            for n in used:
                s = steps[n]
                busy = merged_spans(s.spans)
                row = {"step": n, "pieces": s.pieces, "bytes": s.nbytes, "comm_busy_s": sum(b - a for a, b in busy),
                       "blocked_s": s.blocked_s, "first_layer_wait_s": None, "tail_s": None,
                       "busy_in_backward_s": None, "anchor": busy[0][0] if busy else None}
                if s.ready:  # engine notifiers saw backward write the gradients
                    end = row["anchor"] = max(s.ready.values())
                    urgent = min(s.landed, key=lambda t: (s.priority.get(t, 0), t))
                    row.update(first_layer_wait_s=max(0.0, s.landed[urgent] - end),
                               tail_s=max(0.0, max(s.landed.values()) - end),
                               busy_in_backward_s=sum(max(0.0, min(b, end) - a) for a, b in busy))
                rows.append(row)
        periods = [b["anchor"] - a["anchor"] for a, b in zip(rows, rows[1:], strict=False)
                   if b["step"] == a["step"] + 1 and a["anchor"] is not None and b["anchor"] is not None]

        def mean(key: str) -> float | None:
            values = [r[key] for r in rows if r[key] is not None]
            return sum(values) / len(values) if values else None

        engine = gate_mode == "engine"
        busy, nbytes = mean("comm_busy_s"), mean("bytes")
        period = sum(periods) / len(periods) if periods else None
        return {
            "steps_measured": len(rows),
            "gate_mode": gate_mode,
            "pieces_per_step": mean("pieces"),
            "bytes_per_step": nbytes,
            "step_s": period,
            "first_layer_wait_s": mean("first_layer_wait_s") if engine else None,
            "tail_s": mean("tail_s"),
            "blocked_s": None if engine else mean("blocked_s"),
            "comm_busy_s": busy,
            "busy_in_backward_s": mean("busy_in_backward_s"),
            "payload_bandwidth_bytes_s": nbytes / busy if nbytes and busy else None,
            "goodput_bytes_s": nbytes / period if nbytes and period else None,
        }


def pslite_comm_s(topology: Any, nbytes: float, pieces: float, servers: int) -> float:
    """Seconds for one step's push and pull of ``nbytes`` in ``pieces`` sub-keys on ``topology``.

    Each of the N workers (``topology.world_size``) pushes ``nbytes`` and pulls them back; a
    node's link (``rails`` × ``inter``, or ``intra`` on one node) carries its
    ``ranks_per_node`` workers' bytes in each direction, and each of the ``servers`` (a node
    of its own, the same link) receives and sends ``N · nbytes / servers``. Full duplex, so
    the busier of the two ends sets the time, plus one α for each push and each pull of a
    piece (a ps-lite server answers sub-keys one at a time).
    """
    if servers < 1:
        raise ValueError(f"servers={servers!r} must be at least 1")
    if nbytes < 0 or pieces < 0:
        raise ValueError(f"nbytes={nbytes!r} and pieces={pieces!r} must be >= 0")
    if topology.nodes > 1:
        alpha, bandwidth = topology.inter.alpha_s, topology.inter.bandwidth * topology.rails
    else:
        alpha, bandwidth = topology.intra.alpha_s, topology.intra.bandwidth
    workers = topology.world_size
    worker_side = topology.ranks_per_node * nbytes
    server_side = workers * nbytes / servers
    return max(worker_side, server_side) / bandwidth + 2 * pieces * alpha


def format_report(numbers: dict[str, Any]) -> str:
    """The summary as a few lines of text; a figure that cannot be measured is named, not zeroed."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.2f} ms"

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value / 1e6:.1f} MB/s"

    s = numbers["settings"]
    lines = [f"commsched KVStore after {numbers['steps']} steps: " + ", ".join(f"{k}={v}" for k, v in s.items())]
    if not numbers["steps_measured"]:
        lines.append("  no complete step measured yet (a step counts once every pushpull of it landed)")
        return "\n".join(lines)
    lines.append(f"  measured over the last {numbers['steps_measured']} complete step(s); step "
                 f"{ms(numbers['step_s'])} (between the ends of two backwards, in the engine)")
    busy, tail = numbers["comm_busy_s"], numbers["tail_s"]  # tail: None without engine notifiers
    if numbers["gate_mode"] == "engine":
        lines.append(f"  exposed communication per step: the next forward's first layer waited "
                     f"{ms(numbers['first_layer_wait_s'])} in its engine gate past the end of backward; "
                     f"communication went on {ms(tail)} after backward (the most the next forward could have "
                     "waited)")
        lines.append("  how much of that the next forward's later layers hid is not measurable from the KVStore "
                     "(their operations are yours, queued in MXNet's engine)")
    else:
        lines.append(f"  exposed communication per step: step() was held {ms(numbers['blocked_s'])} issuing pieces "
                     "(gate='issue'); the engine's own wait for the pulls before the update, and when backward "
                     "ended, are not measurable with gate='issue' (it has no engine notifiers)")
    during = numbers["busy_in_backward_s"]
    share = during / busy if busy and during is not None else None
    lines.append(f"  communicated per step: {(numbers['bytes_per_step'] or 0) / 1e6:.3f} MB in "
                 f"{numbers['pieces_per_step']:.0f} pieces, each pushed and pulled back; pieces in flight "
                 f"{ms(busy)} per step"
                 + ("" if share is None else f", {share:.0%} of that during backward"))
    lines.append(f"  effective bandwidth: {rate(numbers['payload_bandwidth_bytes_s'])} of gradient while pieces "
                 f"were in flight (twice that crossed the link: push and pull); goodput "
                 f"{rate(numbers['goodput_bytes_s'])} (bytes per step / step)")
    expected = numbers.get("expected_comm_s")
    if expected is not None:
        lines.append(f"  on {numbers['topology']}: ps-lite push and pull of these bytes should take "
                     f"{ms(expected)} per step ({numbers['servers']} server(s), the α-β model); measured in "
                     f"flight {ms(busy)}")
        lines.append("  the simulator models all-reduce (ring, two-level), not a parameter server: no simulated "
                     "step for ps-lite")
    else:
        lines.append("  (pass topology=... for the network's expected time: commsched probe writes one, or "
                     "Topology.described/emulated)")
    return "\n".join(lines)
