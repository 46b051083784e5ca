"""Suite-wide: a thread a test left running must fail the run by name, never hold pytest open.

A non-daemon thread still alive when the session ends (an engine's waiter, an in-process link,
a scheduler a test forgot to close) makes the interpreter wait for it at exit: pytest prints its
summary and then never returns, and CI sees a hang instead of a failure. After the session,
what the interpreter does before it joins is done first (commsched's ``close_at_exit`` closes
what a test forgot to close; thread-pool workers, which their own exit hook ends, are left out),
then each remaining thread gets ``LEFTOVER_GRACE_S`` (30 s; ``COMMSCHED_TEST_LEFTOVER_GRACE_S``)
to end; those still alive are reported by name and the process exits with status 1 at once.
"""

from __future__ import annotations

import os
import sys
import threading
import time

LEFTOVER_GRACE_S = float(os.environ.get("COMMSCHED_TEST_LEFTOVER_GRACE_S", "30"))

_leftovers: list[str] = []


def leftover_threads(grace_s: float) -> list[threading.Thread]:
    """The non-daemon threads other than the main one still alive after waiting up to ``grace_s`` in all."""
    lifecycle = sys.modules.get("commsched.lifecycle")
    if lifecycle is not None:
        lifecycle._close_all()  # what interpreter exit runs before joining (threading._register_atexit)
    deadline = time.monotonic() + grace_s
    main = threading.main_thread()
    alive = []
    for thread in threading.enumerate():
        pool_worker = getattr(getattr(thread, "_target", None), "__module__", "") == "concurrent.futures.thread"
        if thread is main or thread.daemon or pool_worker:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            alive.append(thread)
    return alive


def pytest_sessionfinish(session, exitstatus):
    alive = leftover_threads(LEFTOVER_GRACE_S)
    if alive:
        _leftovers[:] = [t.name for t in alive]
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _leftovers:
        terminalreporter.write_line(
            f"FAILED: non-daemon threads still alive {LEFTOVER_GRACE_S:g} s after the last test: {_leftovers}; "
            "the interpreter would wait for them for ever at exit. Close what started them (optimizer, scheduler, "
            "backend, in-process world) in the test that made them.", red=True)


def pytest_unconfigure(config):
    if _leftovers:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # joining them at interpreter exit would hang
