"""Closing what the user forgot to close, before the interpreter exits.

commsched's threads are non-daemon (so work is never cut off silently), which
means the interpreter waits for them at exit. ``close_at_exit`` registers an
object whose ``close(timeout=...)`` stops them; it runs from
``threading._register_atexit``, i.e. before the interpreter joins non-daemon
threads, which a plain ``atexit`` hook would be too late for. Objects are closed
newest first, so a wrapper closes before the scheduler it owns.

``lower_priority`` is how each of those threads, as it starts, takes a lower CPU
priority than the thread that made it (``SchedulerConfig.thread_nice``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import Any

from commsched.errors import CommschedError

__all__ = ["Closeable", "close_at_exit", "join_threads", "lower_priority"]

log = logging.getLogger(__name__)

_refused_nice: list[str] = []  # the first refusal of lower_priority, logged once per process

_live: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()
_installed = False
_lock = threading.Lock()


def _close_all() -> None:
    with _lock:
        items = list(_live.items())
    for obj, timeout_s in reversed(items):
        try:
            obj.close(timeout=timeout_s)
        except Exception as exc:  # exit must go on; say what could not be closed cleanly
            log.warning("closing %s at exit: %s", type(obj).__name__, exc)


def lower_priority(nice: int) -> int | None:
    """Run the calling thread ``nice`` steps lower in CPU priority than it runs now (a thread starts at its
    creator's: the training thread's). Linux only, where nice is a per-thread attribute (setpriority(2)
    with a thread id; elsewhere that id would name a process): the thread's new nice value, or None where
    nothing changed (``nice`` 0, another system, or the call refused: logged once per process, then
    the thread runs on at its priority). Raising one's own nice value needs no privilege."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        value = min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError as exc:  # a sandbox that filters the call, say
        if not _refused_nice:
            _refused_nice.append(str(exc))
            log.warning("commsched: thread_nice=%d not applied (%s); its threads run at the training thread's "
                        "priority", nice, exc)
        return None
    return value


def join_threads(threads: list[threading.Thread], timeout_s: float) -> None:
    """Join each thread (but the calling one) for at most ``timeout_s``; log one that did not stop."""
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                log.error("commsched thread %s did not stop", thread.name)


def close_at_exit(obj: Any, timeout_s: float) -> None:
    """Call ``obj.close(timeout=timeout_s)`` at interpreter exit unless it was collected.

    Closing twice must be harmless for ``obj`` (the user may have closed it already).
    """
    global _installed
    with _lock:
        _live[obj] = timeout_s
        if _installed:
            return
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_close_all)
        else:  # pragma: no cover - Pythons before 3.9
            import atexit

            atexit.register(_close_all)
        _installed = True


_CLOSE_AFTER_ERROR_S = 5.0  # what is pending after an exception will rarely land: do not wait long


class Closeable:
    """The context manager of every commsched object that owns work: schedulers, optimizers, KVStores.

    ``with obj:`` calls ``obj.close()`` on a normal exit. When the block raises, ``close``
    waits at most ``min(config.timeout_s, 5 s)`` and a commsched error it raises is logged,
    not raised, so that the exception already propagating is the one the user sees.
    Subclasses provide ``config`` and ``close(timeout=None)``.
    """

    config: Any

    def close(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def __enter__(self):  # noqa: ANN204 - returns the subclass
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(timeout=min(self.config.timeout_s, _CLOSE_AFTER_ERROR_S))
        except CommschedError:
            log.debug("closing %s after an exception", type(self).__name__, exc_info=True)
