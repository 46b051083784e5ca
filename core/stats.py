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
        # per kept step: (its per_step entry, its order, issued_at, ready_at, landed_at): one lookup a piece
        self._rows: dict[int, tuple[dict[str, Any], list, list, list, list]] = {}

    def task(self) -> None:
        self.totals["tasks"] += 1

    def _new_step(self, step: int) -> tuple[dict[str, Any], list, list, list, list]:
        per_step = self.per_step[step] = {"pieces": 0, "bytes": 0, "order": []}
        times = self.issue_times[step] = {"issued_at": [], "ready_at": [], "landed_at": []}
        for kept in (self.per_step, self.issue_times, self._rows):
            kept.pop(step - _STEPS_KEPT, None)
        row = self._rows[step] = (per_step, per_step["order"], times["issued_at"], times["ready_at"],
                                  times["landed_at"])
        return row

    def issued(self, piece: Any, in_flight_bytes: int) -> None:
        """Count ``piece`` as started (once per piece; the scheduler's hot path: no more than it needs)."""
        totals, nbytes = self.totals, piece.nbytes
        totals["pieces"] += 1
        totals["bytes"] += nbytes
        if in_flight_bytes > totals["max_in_flight_bytes"]:
            totals["max_in_flight_bytes"] = in_flight_bytes
        step = piece.task.step
        row = self._rows.get(step) or self._new_step(step)
        per_step, order, issued_at, ready_at, landed_at = row
        per_step["pieces"] += 1
        per_step["bytes"] += nbytes
        order.append(piece.name)
        now = time.time()
        piece.stat_slot = (landed_at, len(landed_at))
        issued_at.append(now)
        landed_at.append(None)
        # submitted_us and issued_us are on the timeline's monotonic clock: their difference
        # moves the submission onto the wall clock.
        waited_us = piece.issued_us - piece.task.submitted_us
        ready_at.append(now - waited_us / 1e6 if waited_us > 0.0 else now)

    def landed(self, piece: Any) -> None:
        """Stamp ``landed_at`` of ``piece`` (a step no longer kept keeps its list until no piece names it)."""
        slot = piece.stat_slot
        if slot is not None:
            slot[0][slot[1]] = time.time()

    def snapshot(self) -> dict[str, Any]:
        """A copy: the totals, ``per_step`` and ``issue_times``."""
        return dict(self.totals, per_step={s: dict(v, order=list(v["order"])) for s, v in self.per_step.items()},
                    issue_times={s: {k: list(v) for k, v in t.items()} for s, t in self.issue_times.items()})
