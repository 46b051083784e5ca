"""A picture of a few training steps from a Chrome trace: what a person looks at first.

For each rank, a **compute** lane (the user's thread: forward/backward/optimizer,
with the time it waited on communication shaded red: the exposed communication)
and a **network** lane (each collective or piece as a bar, stacked when several
are in flight). Reads both traces commsched writes:

* the runtime timeline (:mod:`commsched.timeline`): lanes QUEUED / COMM / UPDATE /
  WAIT per rank and ``step N end`` markers;
* the simulator's trace (:mod:`commsched.costmodel.simulator`): lane 0 holds
  compute tasks and WAIT spans, lane 1 the network.

Only the last ``steps`` steps are drawn (the steady state), so a long run stays
readable.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

__all__ = ["draw_timeline", "lanes_from_trace"]

_RUNTIME_COMM, _RUNTIME_UPDATE, _RUNTIME_WAIT = 2, 3, 4


def lanes_from_trace(events: Iterable[dict[str, Any]]) -> tuple[dict[int, dict[str, list]], list[float]]:
    """Per rank: ``{"compute": [(start, end, name)], "wait": [...], "network": [...], "simulated": bool}``
    in seconds, and the step boundaries found. Works on the runtime timeline and on the simulator's trace."""
    ranks: dict[int, dict[str, list]] = {}
    marks: list[float] = []
    simulated = False
    spans = []
    for e in events:
        if e.get("ph") == "i" or (e.get("ph") == "X" and e.get("name", "").startswith("step ")):
            marks.append(e["ts"] / 1e6)
            continue
        if e.get("ph") != "X":
            continue
        spans.append(e)
        if e.get("args", {}).get("kind") in ("forward", "backward", "apply", "overhead"):
            simulated = True
    for e in spans:
        lanes = ranks.setdefault(int(e.get("pid", 0)),
                                 {"compute": [], "wait": [], "network": [], "simulated": simulated})
        start, end = e["ts"] / 1e6, (e["ts"] + e.get("dur", 0.0)) / 1e6
        tid, name = e.get("tid"), e.get("name", "")
        if simulated:
            lane = "network" if tid == 1 else ("wait" if name == "WAIT" else "compute")
        else:
            lane = {_RUNTIME_COMM: "network", _RUNTIME_UPDATE: "compute", _RUNTIME_WAIT: "wait"}.get(tid)
        if lane is not None:
            lanes[lane].append((start, end, name))
    return ranks, sorted(marks)


def _stack(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str, int]]:
    """Give overlapping spans rows (0, 1, ...) so bars in flight together are all visible."""
    rows: list[float] = []
    out = []
    for start, end, name in sorted(spans):
        row = next((i for i, free in enumerate(rows) if free <= start + 1e-9), len(rows))
        if row == len(rows):
            rows.append(end)
        else:
            rows[row] = end
        out.append((start, end, name, row))
    return out


def draw_timeline(trace: str | list[dict[str, Any]], path: str, title: str = "", steps: int = 2) -> str:
    """Draw the last ``steps`` steps of ``trace`` (a Chrome-trace file or its events) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if isinstance(trace, str):
        with open(trace) as fh:
            events = json.load(fh)["traceEvents"]
    else:
        events = trace
    ranks, marks = lanes_from_trace(events)
    if not ranks:
        raise ValueError("the trace has no spans to draw (was the timeline enabled?)")
    every = [s for lanes in ranks.values() for key in ("compute", "wait", "network") for s in lanes[key]]
    t_end = max(s[1] for s in every)
    t0 = marks[-steps - 1] if len(marks) > steps else min(s[0] for s in every)
    t1 = marks[-1] if len(marks) > steps and marks[-1] > t0 else t_end
    fig_h = 1.2 + 1.6 * len(ranks)
    fig, ax = plt.subplots(figsize=(12, fig_h))
    y, ticks, labels = 0.0, [], []
    for rank in sorted(ranks, reverse=True):
        lanes = ranks[rank]
        net = [s for s in _stack(lanes["network"]) if s[1] > t0 and s[0] < t1]
        depth = max((s[3] for s in net), default=0) + 1
        for start, end, _name, row in net:
            h = 0.8 / depth
            ax.broken_barh([(start - t0, end - start)], (y + row * h, h * 0.9), facecolors="#4C72B0")
        ticks.append(y + 0.4)
        labels.append(f"rank {rank} network")
        y += 1.0
        busy = [(s, e) for s, e, _ in lanes["compute"] if e > t0 and s < t1]
        if not lanes["simulated"]:  # the runtime records waits and updates; the thread computes otherwise
            ax.broken_barh([(0.0, t1 - t0)], (y, 0.8), facecolors="#A8D5B5")
        ax.broken_barh([(s - t0, e - s) for s, e in busy], (y, 0.8), facecolors="#55A868")
        waits = [(s, e) for s, e, _ in lanes["wait"] if e > t0 and s < t1]
        ax.broken_barh([(s - t0, e - s) for s, e in waits], (y, 0.8), facecolors="#C44E52", alpha=0.85)
        ticks.append(y + 0.4)
        labels.append(f"rank {rank} compute")
        y += 1.4
    for m in marks:
        if t0 <= m <= t1:
            ax.axvline(m - t0, color="0.3", linestyle=":", linewidth=1)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels)
    ax.set_xlim(0, max(t1 - t0, 1e-9))
    ax.set_xlabel("seconds (dotted lines: step boundaries)")
    exposed = sum(min(e, t1) - max(s, t0) for lanes in ranks.values() for s, e, _ in lanes["wait"]
                  if e > t0 and s < t1) / len(ranks)
    ax.set_title((title + "\n" if title else "") + f"last {steps} step(s): exposed communication {exposed:.3f} s "
                 "per rank (red)")
    fig.legend(handles=[Patch(color="#55A868", label="compute (forward, backward, update; light: not itemised)"),
                        Patch(color="#C44E52", label="waiting on communication (exposed)"),
                        Patch(color="#4C72B0", label="collectives / pieces on the network")],
               loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.12 * 3.0 / fig_h, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
