"""Closing what the user forgot to close, before the interpreter exits.

commsched's threads are non-daemon (so work is never cut off silently), which
means the interpreter waits for them at exit. ``close_at_exit`` registers an
object whose ``close(timeout=...)`` stops them; it runs from
``threading._register_atexit``, i.e. before the interpreter joins non-daemon
threads, which a plain ``atexit`` hook would be too late for. Objects are closed
newest first, so a wrapper closes before the scheduler it owns.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

__all__ = ["close_at_exit"]

log = logging.getLogger(__name__)

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
