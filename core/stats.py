"""The scheduler's counters (``Scheduler.stats()``)."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Counters"]

_STEPS_KEPT = 3


class Counters:
    """Pieces and bytes started, tasks, the most bytes ever in flight, and for the last
    few steps the pieces, bytes and the order in which pieces started. Not thread-safe:
    the scheduler updates it under its lock.

    ``issue_times`` (same steps) stamps each started piece, in start order, with three wall
    clock times (``time.time()``, seconds): ``issued_at``, when this rank decided to start
    it, ``ready_at``, when its tensor was submitted (the data was ready), and ``landed_at``,
    when the engine reported it done (None until then, or if it failed). Kept apart
    from ``per_step``, which ranks compare for equality. On one machine (the benchmark's
    emulated cluster) the clocks of all ranks are the same clock, so rank 0's ``issued_at``
    against a follower's is the latency from rank 0's decision to the follower's issue.
    """

    def __init__(self) -> None:
        self.totals = {"pieces": 0, "bytes": 0, "tasks": 0, "max_in_flight_bytes": 0}
        self.per_step: dict[int, dict[str, Any]] = {}
        self.issue_times: dict[int, dict[str, list[float]]] = {}

    def task(self) -> None:
        self.totals["tasks"] += 1

    def issued(self, piece: Any, in_flight_bytes: int) -> None:
        totals = self.totals
        totals["pieces"] += 1
        totals["bytes"] += piece.nbytes
        totals["max_in_flight_bytes"] = max(totals["max_in_flight_bytes"], in_flight_bytes)
        step = piece.task.step
        per_step = self.per_step.get(step)
        if per_step is None:
            per_step = self.per_step[step] = {"pieces": 0, "bytes": 0, "order": []}
            self.per_step.pop(step - _STEPS_KEPT, None)
            self.issue_times[step] = {"issued_at": [], "ready_at": [], "landed_at": []}
            self.issue_times.pop(step - _STEPS_KEPT, None)
        per_step["pieces"] += 1
        per_step["bytes"] += piece.nbytes
        per_step["order"].append(piece.name)
        now = time.time()
        times = self.issue_times[step]
        piece.stat_slot = (step, len(times["issued_at"]))
        times["issued_at"].append(now)
        times["landed_at"].append(None)
        # submitted_us and issued_us are on the timeline's monotonic clock: their difference
        # moves the submission onto the wall clock.
        waited_us = getattr(piece, "issued_us", 0.0) - getattr(piece.task, "submitted_us", 0.0)
        times["ready_at"].append(now - max(0.0, waited_us) / 1e6)

    def landed(self, piece: Any) -> None:
        """Stamp ``landed_at`` of ``piece`` (if its step is still kept)."""
        if piece.stat_slot is None:
            return
        step, index = piece.stat_slot
        times = self.issue_times.get(step)
        if times is not None:
            times["landed_at"][index] = time.time()

    def snapshot(self) -> dict[str, Any]:
        """A copy: the totals, ``per_step`` and ``issue_times``."""
        return dict(self.totals, per_step={s: dict(v, order=list(v["order"])) for s, v in self.per_step.items()},
                    issue_times={s: {k: list(v) for k, v in t.items()} for s, t in self.issue_times.items()})
