"""The scheduler's counters (``Scheduler.stats()``)."""

from __future__ import annotations

from typing import Any

__all__ = ["Counters"]

_STEPS_KEPT = 3


class Counters:
    """Pieces and bytes started, tasks, the most bytes ever in flight, and for the last
    few steps the pieces, bytes and the order in which pieces started. Not thread-safe:
    the scheduler updates it under its lock."""

    def __init__(self) -> None:
        self.totals = {"pieces": 0, "bytes": 0, "tasks": 0, "max_in_flight_bytes": 0}
        self.per_step: dict[int, dict[str, Any]] = {}

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
        per_step["pieces"] += 1
        per_step["bytes"] += piece.nbytes
        per_step["order"].append(piece.name)

    def snapshot(self) -> dict[str, Any]:
        """A copy: the totals and ``per_step``."""
        return dict(self.totals, per_step={s: dict(v, order=list(v["order"])) for s, v in self.per_step.items()})
