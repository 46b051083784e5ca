"""The bound on a reduction that makes no progress: one thread per process, not one per collective.

TensorFlow implements a collective's ``timeout_seconds`` with a thread that sleeps for
the timeout (``Env::SchedClosureAfter``): measured here, 200 collectives with a 30 s
timeout left 407 threads alive, so a training run holds ``pieces per second x
timeout_s`` sleeping threads and dies when the process can make no more ("Resource
temporarily unavailable"). commsched's pieces therefore run without a TF timeout, and
this watchdog bounds them instead:

* the graph counts, per traced reduction, the runs that *started* (once the plan's first
  gradient exists) and those that *finished* (every piece landed):
  :class:`~commsched.plugins.tensorflow.measure.Recorder`;
* one named thread (``commsched-tf-watchdog``) reads the counters every
  :data:`POLL_S`; a reduction that started and has neither finished nor let another run
  start or finish for ``timeout_s`` aborts TensorFlow's collectives with
  ``DEADLINE_EXCEEDED`` and a message naming it. The pending piece then fails, and
  :mod:`.failures` makes that a :class:`~commsched.errors.CommschedTimeout`.

The thread starts with the first reduction over more than one worker; it is stopped
and joined when the last open optimizer or tape using it closes (:func:`release`), or at
interpreter exit (:func:`commsched.lifecycle.close_at_exit`), and never holds the GIL
while it waits. Aborting uses ``context.abort_collective_ops``, the
call ``MultiWorkerMirroredStrategy``'s own health check makes.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable

import tensorflow as tf

from commsched.lifecycle import close_at_exit, join_threads

__all__ = ["POLL_S", "Watchdog", "close", "release", "watch"]

log = logging.getLogger(__name__)

#: Seconds between two reads of the counters.
POLL_S = 0.25


class Watchdog:
    """Watches ``records()`` (objects with ``recorder``, ``settings``) and aborts TF's collectives
    when one of them makes no progress for its ``settings["timeout_s"]``."""

    def __init__(self, records: Callable[[], list[Any]], abort: Callable[[str], None] | None = None) -> None:
        self._records = records
        self._abort = abort or _abort_collectives
        self._seen: dict[int, tuple[tuple[int, int], float]] = {}  # id(recorder) -> (counters, since)
        self._stop = threading.Event()
        self.aborted: str | None = None
        self._thread = threading.Thread(target=self._run, name="commsched-tf-watchdog", daemon=False)
        self._thread.start()
        close_at_exit(self, POLL_S * 4)

    def check(self, now: float | None = None) -> str | None:
        """One look at the counters; returns the abort message if it aborted now."""
        now = time.monotonic() if now is None else now
        for record in self._records():
            recorder = record.recorder
            counters = recorder.progress()
            key = id(recorder)
            previous = self._seen.get(key)
            if previous is None or previous[0] != counters:
                self._seen[key] = (counters, now)
                continue
            started, finished = counters
            timeout_s = float(record.settings.get("timeout_s", 0) or 0)
            if started > finished and timeout_s > 0 and now - previous[1] > timeout_s and self.aborted is None:
                names = [p.name for p in record.plan.pieces[:3]]
                message = (f"commsched: a gradient reduction on worker {record.settings.get('rank', '?')} (pieces "
                           f"{', '.join(names)}{' ...' if len(record.plan.pieces) > 3 else ''}) made no progress for "
                           f"{timeout_s:g} s: another worker is hung, dead or too slow (raise "
                           "SchedulerConfig(timeout_s=...) if progress is just slow)")
                self.aborted = message
                log.error("%s; aborting TensorFlow's collectives", message)
                self._abort(message)
                return message
        return None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception:  # a read failed (TF shutting down): stop watching, say so once
                log.exception("commsched's TensorFlow watchdog stopped")
                return

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread and join it (at most ``timeout``, default 1 s). Idempotent."""
        self._stop.set()
        join_threads([self._thread], POLL_S * 4 if timeout is None else timeout)


def _abort_collectives(message: str) -> None:
    from tensorflow.python.eager import context

    context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, message)


_watchdog: Watchdog | None = None
_users: "weakref.WeakSet[Any]" = weakref.WeakSet()
_lock = threading.Lock()


def watch(records: Callable[[], list[Any]], user: Any) -> Watchdog:
    """The process's watchdog over ``records``, for ``user`` (a reducer; started on first use)."""
    global _watchdog
    with _lock:
        _users.add(user)
        if _watchdog is None or not _watchdog._thread.is_alive():
            _watchdog = Watchdog(records)
        return _watchdog


def release(user: Any) -> None:
    """``user`` is closed: stop and join the watchdog once no open user is left (a later
    reduction over several workers starts a new one). A graph traced before keeps running
    its pieces, unwatched."""
    global _watchdog
    with _lock:
        _users.discard(user)
        if _users:
            return
        dog, _watchdog = _watchdog, None
    if dog is not None:
        dog.close()


def close() -> None:
    """Stop the process's watchdog whoever uses it."""
    global _watchdog
    with _lock:
        _users.clear()
        dog, _watchdog = _watchdog, None
    if dog is not None:
        dog.close()
