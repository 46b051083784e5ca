"""Chrome-trace timeline (open the JSON in https://ui.perfetto.dev or chrome://tracing).

One process lane per rank; threads: QUEUED (submitted, waiting for its turn),
COMM (in flight in the engine), UPDATE (the plugin applying the result), and
step markers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

__all__ = ["Timeline", "now_us", "rank_path"]

_LANES = {"QUEUED": 1, "COMM": 2, "UPDATE": 3, "WAIT": 4}


def now_us() -> float:
    """Monotonic time in microseconds, the timeline's clock."""
    return time.perf_counter_ns() / 1000.0


def rank_path(path: str, rank: int, world_size: int) -> str:
    """The file one rank writes: ``{rank}`` in ``path`` is replaced; otherwise, with
    more than one rank, ``.rank<r>`` goes before the extension."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world_size <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Timeline:
    """Collects spans in memory and writes them as Chrome-trace JSON on :meth:`write`.

    Recording is a list append under a lock: cheap enough to leave on for a whole
    benchmark. Nothing is written unless a path was configured.
    """

    def __init__(self, path: str | None, rank: int = 0, world_size: int = 1) -> None:
        self.path = rank_path(path, rank, world_size) if path else None
        self.rank = rank
        self._events: list[dict] = []
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def span(self, lane: str, name: str, start_us: float, end_us: float, **args: object) -> None:
        """Record ``name`` on ``lane`` from ``start_us`` to ``end_us`` (see :func:`now_us`)."""
        if self.path is None:
            return
        event = {"name": name, "cat": lane, "ph": "X", "ts": start_us, "dur": max(0.0, end_us - start_us),
                 "pid": self.rank, "tid": _LANES.get(lane, 9)}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    def instant(self, name: str, **args: object) -> None:
        """Record a marker (a step boundary, say) across the whole rank."""
        if self.path is None:
            return
        event = {"name": name, "cat": "STEP", "ph": "i", "s": "p", "ts": now_us(), "pid": self.rank, "tid": 0}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    def write(self) -> str | None:
        """Write everything recorded so far; returns the path, or None when disabled."""
        if self.path is None:
            return None
        with self._lock:
            events = list(self._events)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}}
                 for lane, tid in _LANES.items()]
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, fh)
        os.replace(tmp, self.path)
        return self.path

    def write_or_warn(self) -> str | None:
        """:meth:`write`, logging (not raising) a file-system error: closing must go on."""
        try:
            return self.write()
        except OSError as exc:
            logging.getLogger(__name__).warning("could not write the timeline to %s: %s", self.path, exc)
            return None

    def piece(self, piece: Any, end_us: float) -> None:
        """A piece's QUEUED (submitted → started) and COMM (started → ``end_us``) spans."""
        if self.enabled:
            step = piece.task.step
            self.span("QUEUED", piece.name, piece.task.submitted_us, piece.issued_us, step=step)
            self.span("COMM", piece.name, piece.issued_us, end_us, bytes=piece.nbytes, step=step)
