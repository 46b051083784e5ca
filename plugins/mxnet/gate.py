"""Engine gates: hold an NDArray inside MXNet's dependency engine until Python opens it.

MXNet runs every operation asynchronously in its engine, ordered only by the
variables each one reads and writes. A forward already queued in the engine
reads a weight as soon as the update before it finished; an update issued later
from Python is simply missed (the forward reads stale weights). commsched issues
pieces later, when credit allows, so it must make the engine *wait*:

* :meth:`Gates.gate` pushes an asynchronous engine operation that *writes* the
  array. Everything queued after it on that array (the optimizer's update, the
  next forward) waits until :meth:`Gate.open` is called, layer by layer, inside
  the engine: the Python thread is never blocked.
* :meth:`Gates.notify` pushes an operation that *reads* an array and calls a
  Python function once every earlier write to it has finished (used to learn
  that backward produced a gradient, or that a pull landed).
* :func:`avatar` returns an NDArray on the same memory with a fresh engine
  variable, so communication can write the memory while the original variable
  is gated (gating the variable the pull writes would deadlock).

The operations go through ``MXEnginePushAsyncND`` / ``MXEnginePushSyncND`` of
libmxnet's C API (ctypes). :func:`available` says whether this libmxnet exports
them; when it does not, the KVStore uses ``gate="issue"`` (``pushpull`` returns
once its pieces are issued to the engine, which orders the update after them).

A gate must be opened exactly once, also on errors and at exit: an engine that
still holds a closed gate hangs or aborts at shutdown. :class:`Gates` tracks
every gate it made and :meth:`Gates.open_all` opens the ones still closed. A
:class:`Watchdog` fails the scheduler when a gate stays closed past its timeout
(a dead worker), so the engine is released instead of hanging.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from typing import Callable

import mxnet as mx
from mxnet.base import _LIB, check_call

from commsched.errors import CommschedTimeout
from commsched.scheduler import Scheduler

__all__ = ["Gate", "Gates", "Watchdog", "available", "avatar"]

log = logging.getLogger(__name__)

# typedef void (*EngineAsyncFunc)(void* rctx, void* on_complete, void* param);
_ASYNC_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
# typedef void (*EngineSyncFunc)(void* rctx, void* param);
_SYNC_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
# engine::CallbackOnComplete: { void (*callback_)(Engine*, void*, const dmlc::Error*); Engine* engine_; void* param_; }
_ON_COMPLETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


_KEEP_ALIVE: list = []  # trampolines handed to the engine (a few bytes per Gates)


class _OnComplete(ctypes.Structure):
    _fields_ = [("callback", ctypes.c_void_p), ("engine", ctypes.c_void_p), ("param", ctypes.c_void_p)]


class _Context(ctypes.Structure):
    # mxnet::Context { DeviceType dev_type; int32_t dev_id; }
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int32)]


def available() -> bool:
    """Whether libmxnet exports the engine calls the gates need."""
    return all(hasattr(_LIB, name) for name in ("MXEnginePushAsyncND", "MXEnginePushSyncND"))


def avatar(array: mx.nd.NDArray) -> mx.nd.NDArray:
    """An NDArray on ``array``'s memory with a fresh engine variable.

    Waits until every queued operation on ``array`` finished (DLPack's write
    export does), so make avatars *before* gating ``array``: afterwards that
    wait would never end. The avatar keeps ``array``'s memory alive.
    """
    return mx.nd.from_dlpack(array.to_dlpack_for_write())


class Gate:
    """A closed gate on one NDArray: engine operations queued after it wait until :meth:`open`."""

    __slots__ = ("name", "created", "_lock", "_complete", "_opened", "_owner", "_token")

    def __init__(self, name: str, owner: "Gates", token: int) -> None:
        self.name = name
        self.created = time.monotonic()
        self._lock = threading.Lock()
        self._complete: tuple[int, int, int] | None = None  # set when the engine runs the gate
        self._opened = False
        self._owner = owner
        self._token = token

    @property
    def is_open(self) -> bool:
        """True once :meth:`open` was called."""
        return self._opened

    def _reached(self, complete: tuple[int, int, int]) -> None:
        # Engine thread: the gate's turn has come; it finishes when opened.
        with self._lock:
            if not self._opened:
                self._complete = complete
                return
        _call_on_complete(complete)

    def open(self) -> None:
        """Let the operations waiting behind this gate run. Idempotent; any thread."""
        with self._lock:
            if self._opened:
                return
            self._opened = True
            complete, self._complete = self._complete, None
        self._owner._forget(self._token)
        if complete is not None:
            _call_on_complete(complete)


def _call_on_complete(complete: tuple[int, int, int]) -> None:
    callback, engine, param = complete
    _ON_COMPLETE(callback)(engine, param, None)


class Gates:
    """Makes gates and notifiers for arrays on one context; tracks the gates still closed."""

    def __init__(self, context: mx.Context | None = None) -> None:
        if not available():
            raise RuntimeError("this libmxnet does not export MXEnginePushAsyncND/MXEnginePushSyncND, which engine "
                               "gates need; create the KVStore with gate='issue' (gate='auto' chooses it by itself)")
        ctx = context if context is not None else mx.cpu()
        self._ctx = _Context(ctx.device_typeid, ctx.device_id)
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._gates: dict[int, Gate] = {}
        self._notifiers: dict[int, Callable[[], None]] = {}
        # The engine may call these after this object is dropped (an operation still
        # queued at exit): the trampolines, and through them this object, must
        # never be freed, or that call jumps into freed memory.
        self._async_fn = _ASYNC_FUNC(self._run_gate)
        self._sync_fn = _SYNC_FUNC(self._run_notifier)
        _KEEP_ALIVE.append((self._async_fn, self._sync_fn))

    def gate(self, array: mx.nd.NDArray, name: str = "") -> Gate:
        """Queue a closed gate that writes ``array``; returns it. Open it with :meth:`Gate.open`."""
        with self._lock:
            token = next(self._tokens)
            gate = Gate(name, self, token)
            self._gates[token] = gate
        handles = (ctypes.c_void_p * 1)(array.handle)
        try:
            check_call(_LIB.MXEnginePushAsyncND(
                self._async_fn, ctypes.c_void_p(token), None, ctypes.byref(self._ctx),
                None, 0, handles, 1, None, 0, ctypes.c_char_p(b"commsched_gate"), ctypes.c_bool(False)))
        except BaseException:
            self._forget(token)
            raise
        return gate

    def notify(self, array: mx.nd.NDArray, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on an engine thread) once every queued write to ``array`` finished.

        ``callback`` must be quick and must not raise: it runs inside the engine.
        """
        with self._lock:
            token = next(self._tokens)
            self._notifiers[token] = callback
        handles = (ctypes.c_void_p * 1)(array.handle)
        try:
            check_call(_LIB.MXEnginePushSyncND(
                self._sync_fn, ctypes.c_void_p(token), None, ctypes.byref(self._ctx),
                handles, 1, None, 0, None, 0, ctypes.c_char_p(b"commsched_notify")))
        except BaseException:
            with self._lock:
                self._notifiers.pop(token, None)
            raise

    def closed(self) -> list[Gate]:
        """The gates not yet opened."""
        with self._lock:
            return list(self._gates.values())

    def open_all(self) -> int:
        """Open every gate still closed (on errors and at exit); returns how many were."""
        gates = self.closed()
        for gate in gates:
            gate.open()
        return len(gates)

    # ------------------------------------------------------------ engine side
    def _forget(self, token: int) -> None:
        with self._lock:
            self._gates.pop(token, None)

    def _run_gate(self, rctx: int, on_complete: int, param: int) -> None:
        # The CallbackOnComplete lives on the caller's stack: copy it now.
        oc = _OnComplete.from_address(on_complete)
        complete = (oc.callback, oc.engine, oc.param)
        try:
            with self._lock:
                gate = self._gates.get(param or 0)
            if gate is None:  # opened before the engine reached it
                _call_on_complete(complete)
                return
            gate._reached(complete)
        except BaseException:  # never leave the engine waiting on a broken gate
            log.exception("commsched engine gate failed; opening it")
            _call_on_complete(complete)

    def _run_notifier(self, rctx: int, param: int) -> None:
        with self._lock:
            callback = self._notifiers.pop(param or 0, None)
        if callback is None:
            return
        try:
            callback()
        except BaseException:  # never let an exception unwind into the engine
            log.exception("commsched engine notifier failed")


class Watchdog:
    """Fails ``scheduler`` when one of ``gates`` stayed closed longer than ``timeout_s``.

    A closed gate blocks the engine, not Python: without this, a dead worker would
    hang the next forward forever instead of raising. Every ``period_s`` while a
    gate is closed, past ``timeout_s`` it calls :meth:`Scheduler.abort` with a
    :class:`CommschedTimeout` (every pending future fails, which must open the
    gates; the error surfaces at the next call), and past ``look_after_s`` it calls
    :meth:`Scheduler.check`, which moves the scheduler to its failed state when
    another worker aborted. One named, non-daemon thread, joined by :meth:`close`.
    """

    def __init__(self, gates: Gates, scheduler: Scheduler, timeout_s: float, *, period_s: float = 0.5,
                 look_after_s: float = 1.0) -> None:
        self._gates = gates
        self._scheduler = scheduler
        self._timeout_s = timeout_s
        self._period_s = period_s
        self._look_after_s = look_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"commsched-mx-watchdog-r{scheduler.rank}",
                                        daemon=False)
        self._thread.start()

    def close(self) -> None:
        """Stop and join the thread. Idempotent."""
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            closed = self._gates.closed() if self._scheduler.error is None else []
            if not closed:
                continue
            age = time.monotonic() - min(g.created for g in closed)
            if age > self._timeout_s:
                self._scheduler.abort(CommschedTimeout(f"the transfers of {len(closed)} array(s) the engine "
                                                       "waits for", self._timeout_s, self._scheduler.pending()))
            elif age > self._look_after_s:
                try:
                    self._scheduler.check()  # raises a background error or another worker's abort
                except Exception:
                    log.debug("the watchdog found the scheduler failed", exc_info=True)
