"""A KVStore that schedules ps-lite push/pull by priority, in pieces, within a credit window.

Usage (the Gluon ``Trainer`` is unchanged)::

    import commsched.plugins.mxnet            # registers the KVStore type 'commsched'
    kv = mx.kv.create("commsched")            # dist_sync underneath; settings from COMMSCHED_*
    trainer = gluon.Trainer(net.collect_params(), "sgd", {...}, kvstore=kv)

What happens in ``trainer.step()``, for each parameter ``i`` (``pushpull(i, grad)``):

1. The gradient's memory gets *piece avatars*: for each piece ``[a, b)`` an NDArray
   on the same memory with an engine variable of its own (made once). Pieces then
   travel independently in the engine, and the gradient's own variable stays free
   to be gated.
2. A *gate* is queued on the gradient (``update_on_kvstore=False``) or on the weight
   (``update_on_kvstore=True``): the optimizer's update, and through it the next
   forward of that layer, wait inside the engine until the pieces landed. The
   Python thread is not blocked, so the next forward starts layer by layer.
3. The gradient is submitted to the core :class:`~commsched.Scheduler` when it is
   *ready*, i.e. when an engine notifier queued before the gate reports that
   backward wrote it. With ``ordering='dynamic'``/``'static'`` it is submitted at
   once and worker 0's decisions are shared through a small TCP store
   (:mod:`commsched.tcpstore`); with ``ordering='fifo'`` it waits until
   every earlier ``pushpull`` was submitted too, so that every worker submits in
   the Trainer's order (the same everywhere by construction) and needs no store.
4. The scheduler starts pieces by priority (layer 0 first) within the credit;
   each piece is a ``pushpull`` of sub-key ``first_key + index`` (sub-keys start at
   2**24, clear of the Trainer's keys 0..N). When the last piece landed the gate
   opens.

Why the order must be agreed: a ``dist_sync`` server answers a push only after
every worker pushed that key. Two workers whose credit windows hold different
keys wait for each other forever (measured: 256 KB pieces, 8 MB credit).

``update_on_kvstore=True`` (``KVStore(..., update_on_kvstore=True)``): the servers
run the optimizer on each piece (sub-key) separately. Elementwise optimizers
(SGD, momentum, Adam, ...) give the same numbers as on the whole array, but what
the optimizer keys by index does not reach sub-keys: ``optimizer.lr_mult`` /
``wd_mult`` set by index or by name (``idx2name``) are ignored on the servers (the
per-Parameter ``lr_mult``/``wd_mult`` are ignored there by plain ``dist_sync`` too,
since MXNet does not pickle ``param_dict``), and server-side optimizer states
cannot be saved or loaded (as with plain ``dist_sync``). Optimizers that look at a
whole array at once (LARS, LAMB's trust ratio) would see pieces: use the default
local update for them.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import mxnet as mx
import numpy as np

from commsched.config import SchedulerConfig
from commsched.errors import CommschedError, CommschedTimeout, SchedulerClosed
from commsched.partition import piece_bounds
from commsched.scheduler import Scheduler
from commsched.plugins.mxnet import gate as gate_mod
from commsched.plugins.mxnet.backends import KVStoreBackend, advertised_host
from commsched.lifecycle import close_at_exit
from commsched.tcpstore import StoreClient, StoreServer
from commsched.plugins.mxnet.tensor_ops import Transfer, TransferOps, check_array, flat

__all__ = ["FIRST_SUB_KEY", "KVStore"]

log = logging.getLogger(__name__)

FIRST_SUB_KEY = 1 << 24
"""The first KVStore key commsched uses; the Trainer's own keys are 0..N, far below."""
_LAST_SUB_KEY = (1 << 31) - 1  # keys travel as C int
_GATE_MODES = ("auto", "engine", "issue")
_WATCH_S = 0.5  # watchdog period
_HEALTH_AFTER_S = 1.0  # a gate closed this long makes the watchdog ask the scheduler for errors

# Sub-keys of every commsched KVStore that wraps the same ps-lite store, so that
# several of them (a test comparing settings, say) never share a key.
_next_sub_key: "weakref.WeakKeyDictionary[mx.kv.KVStore, int]" = weakref.WeakKeyDictionary()
_next_sub_key_lock = threading.Lock()


def _allocate_sub_keys(inner: mx.kv.KVStore, count: int) -> int:
    with _next_sub_key_lock:
        first = _next_sub_key.get(inner, FIRST_SUB_KEY)
        if first + count - 1 > _LAST_SUB_KEY:
            raise ValueError(f"commsched ran out of KVStore sub-keys ({count} more needed); use a larger "
                             "partition_bytes so that tensors are cut into fewer pieces")
        _next_sub_key[inner] = first + count
    return first


class _Entry:
    """One user key: its shape, its sub-keys and the transfer of the latest ``pushpull``."""

    __slots__ = ("key", "shape", "dtype", "size", "bounds", "first_key", "transfer", "push_buffer", "arrays")

    def __init__(self, key: Any, array: mx.nd.NDArray, bounds: list[tuple[int, int]], first_key: int) -> None:
        self.key = key
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.size = int(array.size)
        self.bounds = bounds
        self.first_key = first_key
        self.transfer: Transfer | None = None
        self.push_buffer: mx.nd.NDArray | None = None
        self.arrays: tuple[Any, Any] = (None, None)

    @property
    def sub_keys(self) -> list[int]:
        return [self.first_key + i for i in range(len(self.bounds))]

    def check(self, array: mx.nd.NDArray, what: str) -> None:
        if tuple(array.shape) != self.shape or np.dtype(array.dtype) != self.dtype:
            raise ValueError(f"key {self.key!r}: {what} has shape {tuple(array.shape)} and dtype {array.dtype}, "
                             f"but the key was initialized with shape {self.shape} and dtype {self.dtype}")


class _Link:
    """Opens a gate once both the gate exists and the reduction finished, in whichever order;
    calls ``on_finish`` once."""

    __slots__ = ("_lock", "_gate", "_finished", "_on_finish")

    def __init__(self, on_finish: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._gate: gate_mod.Gate | None = None
        self._finished = False
        self._on_finish = on_finish

    def set_gate(self, gate: gate_mod.Gate) -> None:
        with self._lock:
            self._gate = gate
            finished = self._finished
        if finished:
            gate.open()

    def finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            gate = self._gate
        if gate is not None:
            gate.open()
        self._on_finish()


def _single(key: Any, values: Any, what: str) -> mx.nd.NDArray:
    if isinstance(values, (list, tuple)):
        if len(values) != 1:
            raise ValueError(f"key {key!r}: {len(values)} {what} arrays given; commsched supports one context "
                             "per worker process (start one worker per device with commsched launch)")
        values = values[0]
    check_array(key, values)
    return values


def _as_items(key: Any, value: Any, out: Any = None) -> list[tuple[Any, Any, Any]]:
    if isinstance(key, (list, tuple)):
        outs = out if out is not None else [None] * len(key)
        if len(value) != len(key) or len(outs) != len(key):
            raise ValueError(f"{len(key)} keys need as many values (got {len(value)}) and outputs")
        return list(zip(key, value, outs, strict=True))
    return [(key, value, out)]


class KVStore(mx.kv.KVStoreBase):
    """A Gluon-compatible KVStore whose push/pull is scheduled by commsched.

    Args:
        kvstore: the ps-lite KVStore to drive: a type name (``"dist_sync"``,
            ``"dist_device_sync"``; ``"local"`` for one process) or an existing
            ``mx.kv.KVStore``. Asynchronous types are refused.
        config: scheduler settings; default ``SchedulerConfig()`` (``COMMSCHED_*``
            environment variables, then defaults).
        update_on_kvstore: allow ``Trainer(update_on_kvstore=True)``: the servers then
            run the optimizer on each piece (see the module docstring for what is
            lost). Default False: the Trainer updates locally, as it does when a
            KVStore cannot hold an optimizer.
        gate: ``"engine"`` holds the update and the next forward inside MXNet's
            engine, layer by layer (needs ``MXEnginePushAsyncND``); ``"issue"``, the
            fallback, makes ``pushpull`` return only once its pieces were issued to
            the engine, which then orders the update after them (correct, but
            step() waits for the credit window); ``"auto"`` picks ``"engine"`` when
            this libmxnet has it.

    Guarantees: every worker starts the same pieces in the same order (so a small
    credit cannot deadlock ``dist_sync``); the result of ``pushpull`` equals plain
    ``dist_sync``'s bit for bit with two workers; an error on a background thread
    or another worker surfaces at the next call, and a reduction stuck for longer
    than ``config.timeout_s`` opens its gates and raises ``CommschedTimeout`` there
    instead of hanging the engine.
    """

    def __init__(self, kvstore: str | mx.kv.KVStore = "dist_sync", config: SchedulerConfig | None = None, *,
                 update_on_kvstore: bool = False, gate: str = "auto") -> None:
        self.config = config if config is not None else SchedulerConfig()
        if gate not in _GATE_MODES:
            raise ValueError(f"gate={gate!r} is not one of {', '.join(_GATE_MODES)}")
        if gate == "engine" and not gate_mod.available():
            raise ValueError("gate='engine' needs MXEnginePushAsyncND in libmxnet, which this build lacks; "
                             "use gate='auto' or 'issue'")
        if isinstance(kvstore, str):
            if "async" in kvstore:
                raise ValueError(f"kvstore={kvstore!r}: commsched schedules synchronous training only; "
                                 "use 'dist_sync' (asynchronous stores need no agreement on order)")
            inner = mx.kv.create(kvstore)
        elif isinstance(kvstore, mx.kv.KVStore):
            inner = kvstore
        else:
            raise TypeError(f"kvstore must be a KVStore type name such as 'dist_sync' or an mx.kv.KVStore, "
                            f"not {type(kvstore).__name__}")
        if "async" in inner.type:
            raise ValueError(f"the wrapped KVStore is {inner.type!r}; commsched schedules synchronous training only")
        self._inner = inner
        self._server_update = bool(update_on_kvstore)
        self._gate_mode = "engine" if gate == "auto" and gate_mod.available() else ("issue" if gate == "auto" else gate)
        self._gates = gate_mod.Gates() if self._gate_mode == "engine" else None
        self._backend = KVStoreBackend(inner, self._gates)
        self._rank = self._backend.rank
        self._world = self._backend.world_size
        self._entries: dict[Any, _Entry] = {}
        self._lock = threading.Lock()  # guards the fields below; never held across MXNet calls
        self._idle_cv = threading.Condition(self._lock)
        self._outstanding = 0  # pushpulls whose result has not landed (submitted or waiting for backward)
        self._tickets = 0  # fifo: submission order
        self._next_ticket = 0
        self._ready: dict[int, tuple] = {}
        self._step = 0
        self._seen: set = set()
        self._marked = 0
        self._error: BaseException | None = None
        self._closed = False
        self._store_server: StoreServer | None = None
        self._store: StoreClient | None = None
        try:
            if self._world > 1 and self.config.ordering != "fifo":
                self._store_server, self._store = self._connect_store()
            self._scheduler = Scheduler(self._backend, TransferOps(), self.config, store=self._store,
                                        key_prefix="commsched-mx")
        except BaseException:
            self._close_resources()
            raise
        self._watch_cv = threading.Condition()
        self._watching = True
        self._watchdog = threading.Thread(target=self._watch, name=f"commsched-mx-watchdog-r{self._rank}",
                                          daemon=False)
        self._watchdog.start()
        close_at_exit(self, min(self.config.timeout_s, 30.0))  # before MXNet shuts its engine down

    # ------------------------------------------------------------ KVStoreBase
    @property
    def type(self) -> str:
        """The wrapped store's type (contains 'dist' for ps-lite stores, as the Trainer expects)."""
        return self._inner.type

    @property
    def rank(self) -> int:
        """This worker's rank, 0..num_workers-1."""
        return self._rank

    @property
    def num_workers(self) -> int:
        """The number of workers."""
        return self._world

    @property
    def scheduler(self) -> Scheduler:
        """The core scheduler (for ``stats()`` and ``pending()``)."""
        return self._scheduler

    @property
    def gate_mode(self) -> str:
        """``"engine"`` or ``"issue"`` (see the class docstring)."""
        return self._gate_mode

    def is_capable(self, capability: str) -> bool:
        """``'optimizer'``: whether the servers may run the optimizer (``update_on_kvstore`` given here)."""
        if capability.lower() == mx.kv.KVStoreBase.OPTIMIZER:
            return self._server_update
        raise ValueError(f"unknown capability {capability!r}")

    def init(self, key: Any, value: Any) -> None:
        """Initialize ``key`` (or a list of keys) with worker 0's ``value``; all sub-keys in one call.

        Every worker must call it, in the same order (each call is a barrier).
        """
        self._check_usable()
        items = _as_items(key, value)
        sub_keys: list[int] = []
        sub_values: list[mx.nd.NDArray] = []
        for k, v, _ in items:
            v = _single(k, v, "value")
            entry = self._register(k, v)
            sub_keys += entry.sub_keys
            sub_values += [flat(v)[a:b] for a, b in entry.bounds]
        if sub_keys:
            self._inner.init(sub_keys, sub_values)

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Initialize ``key`` with worker 0's ``value`` and pull it into ``out`` on every worker.

        Returns once the pulled values are in ``out``. Plain dist_sync returns at once,
        and then its first gradient push of a key can reach the server before this
        worker's pull of the initial value: the pull returns the first gradient sum
        instead of the weights (seen with mxnet 1.9.1 on CPU, about one run in four).
        """
        self.init(key, value)
        targets = []
        for k, _, o in _as_items(key, value, out):
            entry = self._entries[k]
            for target in (o if isinstance(o, (list, tuple)) else [o]):
                check_array(k, target)
                entry.check(target, "out")
                self._inner.pull(entry.sub_keys, out=[flat(target)[a:b] for a, b in entry.bounds],
                                 priority=priority)
                targets.append(target)
        for target in targets:
            target.wait_to_read()

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Sum ``value`` over the workers (or, with ``update_on_kvstore``, push it to the
        servers' optimizer) and put the result in ``out`` (default: ``value`` itself).

        Returns at once. Whatever MXNet queues later on the result waits for it inside
        the engine; ``priority`` follows MXNet (higher is more urgent; the Trainer
        passes ``-index``, so layer 0 goes first).
        """
        self._check_usable()
        for k, v, o in _as_items(key, value, out):
            self._pushpull_one(k, v, o, priority)

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Push without scheduling (ps-lite order); for code that calls push and pull itself."""
        self._check_usable()
        for k, v, _ in _as_items(key, value):
            v = _single(k, v, "value")
            entry = self._entry(k, v)
            self._inner.push(entry.sub_keys, [flat(v)[a:b] for a, b in entry.bounds], priority=priority)

    def pull(self, key: Any, out: Any = None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Pull without scheduling; see :meth:`push`."""
        self._check_usable()
        for k, o, _ in _as_items(key, out):
            for target in (o if isinstance(o, (list, tuple)) else [o]):
                check_array(k, target)
                entry = self._entry(k, target)
                self._inner.pull(entry.sub_keys, out=[flat(target)[a:b] for a, b in entry.bounds],
                                 priority=priority)

    def row_sparse_pull(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("commsched communicates dense arrays only; keep sparse parameters on a plain "
                         "mx.kv.create('dist_sync') KVStore")

    def set_gradient_compression(self, compression_params: dict) -> None:
        raise ValueError("commsched does not combine with MXNet gradient compression; drop "
                         "compression_params or use a plain mx.kv.create('dist_sync')")

    def set_optimizer(self, optimizer: mx.optimizer.Optimizer) -> None:
        """Send ``optimizer`` to the servers (``update_on_kvstore=True`` only); they apply it per piece."""
        self._check_usable()
        if not self._server_update:
            raise ValueError("this commsched KVStore updates locally; create it with "
                             "KVStore(..., update_on_kvstore=True) to run the optimizer on the servers")
        indexed = {name: getattr(optimizer, name) for name in ("lr_mult", "wd_mult", "idx2name")
                   if getattr(optimizer, name, None)}
        if indexed:
            log.warning("update_on_kvstore=True: the servers see commsched sub-keys, not parameter indices, so "
                        "the optimizer's %s are ignored there; use update_on_kvstore=False to keep them",
                        ", ".join(sorted(indexed)))
        self._inner.set_optimizer(optimizer)

    @property
    def _updater(self) -> Any:
        # Trainer.load_states reads kvstore._updater with update_on_kvstore=True.
        return self._inner._updater

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Save the optimizer states held by the store (a non-distributed store only).

        With ``update_on_kvstore=False`` (the default) the Trainer keeps the states
        and ``Trainer.save_states`` never comes here.
        """
        self._check_states()
        self.synchronize()
        self._inner.save_optimizer_states(fname, dump_optimizer=dump_optimizer)

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states saved by :meth:`save_optimizer_states`."""
        self._check_states()
        self.synchronize()
        self._inner.load_optimizer_states(fname)

    def _check_states(self) -> None:
        if "dist" in self.type:
            raise ValueError("with update_on_kvstore=True the optimizer states live on the parameter servers, "
                             "which cannot save or load them (plain dist_sync cannot either); train with "
                             "update_on_kvstore=False, the default, and use Trainer.save_states/load_states")

    def _barrier(self) -> None:
        """Finish every scheduled transfer, then wait for all workers."""
        self.synchronize()
        self._inner._barrier()

    # ------------------------------------------------------------- commsched
    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every ``pushpull`` so far landed (at most ``timeout``, default ``timeout_s``).

        Raises the first error of a background thread or another worker.
        """
        self._check_usable()
        limit = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._idle_cv:
            while self._outstanding:
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommschedTimeout("synchronize()", limit, self._scheduler.pending())
                self._idle_cv.wait(min(left, _WATCH_S))
        self._scheduler.synchronize(max(0.0, deadline - time.monotonic()))
        self._raise_if_failed()

    def outstanding(self) -> int:
        """How many ``pushpull`` results have not landed yet (waiting for backward, queued or in flight)."""
        with self._lock:
            return self._outstanding

    def stats(self) -> dict:
        """The scheduler's counters (pieces, bytes, order per step, ...)."""
        return self._scheduler.stats()

    def close(self, timeout: float | None = None) -> None:
        """Finish pending transfers (at most ``timeout``), open every gate, stop every thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._watch_cv:
            self._watching = False
            self._watch_cv.notify_all()
        self._watchdog.join(timeout=10.0)
        limit = self.config.timeout_s if timeout is None else timeout
        if self._error is not None:
            limit = min(limit, 5.0)  # failed: what is pending will not land
        drain_error: BaseException | None = None
        try:
            self._scheduler.close(limit)
        except BaseException as exc:
            drain_error = exc
        finally:
            self._close_resources()
        self._raise_if_failed()  # the first error says more than a drain timeout after it
        if drain_error is not None:
            raise drain_error

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            try:
                self.close(timeout=min(self.config.timeout_s, 5.0))
            except CommschedError:
                pass  # the exception already propagating says more

    # ------------------------------------------------------------- internals
    def _connect_store(self) -> tuple[StoreServer | None, StoreClient]:
        """Worker 0 serves the order-agreement store; its address reaches the others through the KVStore."""
        server = None
        address = np.zeros(5, dtype=np.float32)
        if self._rank == 0:
            server = StoreServer(advertised_host(), 0)
            octets = [int(x) for x in server.host.split(".")]
            address[:] = octets + [server.port]
        key = _allocate_sub_keys(self._inner, 1)
        try:
            self._inner.init(key, mx.nd.array(address))  # worker 0's value wins; a barrier
            got = mx.nd.zeros(5)
            self._inner.pull(key, out=got)
            values = got.asnumpy().astype(np.int64)
            host = ".".join(str(v) for v in values[:4])
            return server, StoreClient(host, int(values[4]))
        except BaseException:
            if server is not None:
                server.close()
            raise

    def _register(self, key: Any, array: mx.nd.NDArray) -> _Entry:
        if key in self._entries:
            raise ValueError(f"key {key!r} is already initialized in this KVStore")
        if self._entries and isinstance(key, str) != isinstance(next(iter(self._entries)), str):
            raise ValueError(f"key {key!r}: keys must be all int or all str, as in MXNet")
        bounds = piece_bounds(int(array.size), int(np.dtype(array.dtype).itemsize), self.config.partition_bytes)
        first = _allocate_sub_keys(self._inner, len(bounds))
        entry = self._entries[key] = _Entry(key, array, bounds, first)
        return entry

    def _entry(self, key: Any, array: mx.nd.NDArray) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise ValueError(f"key {key!r} was not initialized; call init() or broadcast() first "
                             "(gluon.Trainer does this itself)")
        entry.check(array, "the array")
        return entry

    def _pushpull_one(self, key: Any, value: Any, out: Any, priority: int) -> None:
        value = _single(key, value, "value")
        entry = self._entry(key, value)
        target = None if out is None else _single(key, out, "out")
        if target is not None:
            entry.check(target, "out")
            if target is value:
                target = None
        with self._lock:
            if key in self._seen:  # the Trainer communicates each key once per step
                self._step += 1
                self._seen = set()
            self._seen.add(key)
            step = self._step
            if entry.size:
                self._outstanding += 1
        if entry.size == 0:
            return
        transfer, staging = self._prepare(entry, value, target)
        gated = value if target is None else target
        core_priority = -int(priority)
        if self._gates is None:
            self._issue_and_wait(transfer, staging, core_priority, step)
            return
        link = _Link(self._landed_one)
        if self.config.ordering == "fifo":
            # Submitted in the caller's order (the same on every worker), each once it
            # and every transfer before it are ready: a later transfer never overtakes.
            with self._lock:
                ticket = self._tickets
                self._tickets += 1

            def ready() -> None:
                self._submit_in_order(ticket, (transfer, core_priority, step, link))
        else:
            # Submitted as soon as backward wrote it: readiness is what worker 0 orders by.
            def ready() -> None:
                self._submit(transfer, core_priority, step, link)
        # The notifier reads `staging` before the gate writes it, so it fires when
        # backward (or the copy into the push buffer) finished, never later.
        self._gates.notify(staging, ready)
        link.set_gate(self._gates.gate(gated, transfer.name))

    def _prepare(self, entry: _Entry, value: mx.nd.NDArray, target: mx.nd.NDArray | None
                 ) -> tuple[Transfer, mx.nd.NDArray]:
        """The transfer for this pushpull, and the array whose writes make it ready.

        Without ``out`` the sum replaces ``value``; with ``out`` the value is first
        copied into a push buffer, because ps-lite pulls into the push source and
        ``value`` (a gradient accumulated with grad_req='add') must stay intact.
        """
        if target is None:
            staging = value
        else:
            if entry.push_buffer is None:
                entry.push_buffer = mx.nd.zeros(entry.shape, ctx=value.context, dtype=entry.dtype)
            staging = entry.push_buffer
            value.copyto(staging)
        if entry.transfer is None or entry.arrays[0] is not value or entry.arrays[1] is not target:
            entry.transfer = self._make_transfer(entry, staging, target)
            entry.arrays = (value, target)
        return entry.transfer, staging

    def _make_transfer(self, entry: _Entry, staging: mx.nd.NDArray, target: mx.nd.NDArray | None) -> Transfer:
        # Engine gates need pieces with engine variables of their own ("avatars"):
        # pieces then travel independently, and the gated array's variable stays free.
        # Making an avatar waits for the array's queued operations: this happens
        # once per array, before any gate is queued on it.
        if self._gates is not None:
            make = gate_mod.avatar
        else:
            def make(view: mx.nd.NDArray) -> mx.nd.NDArray:
                return view
        src = [make(flat(staging)[a:b]) for a, b in entry.bounds]
        dst = src if target is None else [make(flat(target)[a:b]) for a, b in entry.bounds]
        return Transfer(name=str(entry.key), size=entry.size, dtype=entry.dtype, first_key=entry.first_key,
                        bounds=list(entry.bounds), pieces=list(zip(src, dst, strict=True)))

    def _submit_in_order(self, ticket: int, args: tuple) -> None:
        # fifo: engine threads report readiness in any order; submit by ticket.
        with self._lock:
            self._ready[ticket] = args
            batch = []
            while self._next_ticket in self._ready:
                batch.append(self._ready.pop(self._next_ticket))
                self._next_ticket += 1
            # Submit while holding the ticket order: another engine thread may be here too.
            submitted = [(self._submit_locked(*item), item[3]) for item in batch]
        for future, link in submitted:
            self._watch_future(future, link)

    def _submit(self, transfer: Transfer, priority: int, step: int, link: _Link) -> Future | None:
        with self._lock:
            future = self._submit_locked(transfer, priority, step, link)
        self._watch_future(future, link)
        return future

    def _submit_locked(self, transfer: Transfer, priority: int, step: int, link: _Link) -> Future | None:
        # Runs on the caller's thread (fallback) or on an MXNet engine thread, with
        # self._lock held: must not raise and must not wait for the engine.
        if self._error is not None:  # failed already: nothing more is reduced
            return None
        try:
            if step > self._marked:
                self._scheduler.mark_step()
                self._marked = step
            return self._scheduler.submit(transfer.name, transfer, priority=priority)
        except BaseException as exc:
            self._error = exc
            return None

    def _watch_future(self, future: Future | None, link: _Link) -> None:
        # Outside our lock: the callback may run right here, and opening gates calls the engine.
        if future is not None:
            future.add_done_callback(lambda f: self._landed(f, link))
            return
        # Not submitted (this store failed): let the engine go on; the error surfaces at the next call.
        link.finish()
        if self._gates is not None:
            self._gates.open_all()

    def _landed(self, future: Future, link: _Link) -> None:
        exc = future.exception()
        if exc is not None:
            self._fail(exc)
        link.finish()

    def _landed_one(self) -> None:
        with self._lock:
            self._outstanding -= 1
            if not self._outstanding:
                self._idle_cv.notify_all()

    def _issue_and_wait(self, transfer: Transfer, staging: mx.nd.NDArray, priority: int, step: int) -> None:
        # Fallback without engine gates: return once every piece was issued, so that
        # what the caller queues next (the update) is ordered after the pulls.
        issued = threading.Event()
        transfer.on_issued = issued.set
        future = self._submit(transfer, priority, step, _Link(self._landed_one))
        if future is None:
            self._raise_if_failed()
        deadline = time.monotonic() + self.config.timeout_s
        while not issued.wait(0.25):
            self._raise_if_failed()
            if future is not None and future.done():
                future.result()
                break
            if time.monotonic() > deadline:
                raise CommschedTimeout(f"issuing the pieces of key {transfer.name!r}", self.config.timeout_s,
                                       self._scheduler.pending())

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        if self._gates is not None:
            self._gates.open_all()

    def _raise_if_failed(self) -> None:
        error = self._error
        if error is not None:
            raise error

    def _check_usable(self) -> None:
        if self._closed:
            raise SchedulerClosed("this commsched KVStore is closed; create a new one")
        self._raise_if_failed()

    def _watch(self) -> None:
        """Open the gates of a stuck reduction after ``timeout_s`` and surface the error at the next call.

        A closed gate blocks the engine, not Python: without this, a dead worker
        would hang the next forward forever instead of raising.
        """
        while True:
            with self._watch_cv:
                self._watch_cv.wait(_WATCH_S)
                if not self._watching:
                    return
            if self._gates is None or self._error is not None:
                continue
            closed = self._gates.closed()
            if not closed:
                continue
            age = time.monotonic() - min(g.created for g in closed)
            if age > self.config.timeout_s:
                self._fail(CommschedTimeout(f"the transfers of {len(closed)} array(s) the engine waits for",
                                            self.config.timeout_s, self._scheduler.pending()))
            elif age > _HEALTH_AFTER_S:
                try:  # polls the other workers' abort notice, raises background errors
                    self._scheduler.synchronize(timeout=_WATCH_S)
                except CommschedTimeout:
                    pass
                except BaseException as exc:
                    self._fail(exc)

    def _close_resources(self) -> None:
        if self._gates is not None:
            opened = self._gates.open_all()
            if opened:
                log.warning("closed a commsched KVStore with %d gate(s) still closed; opened them", opened)
        self._backend.close()
        if self._store is not None:
            self._store.close()
        if self._store_server is not None:
            self._store_server.close()


class Commsched(KVStore):
    """The registered KVStore type: ``mx.kv.create("commsched")`` is ``KVStore("dist_sync")``
    with settings from the ``COMMSCHED_*`` environment."""

    def __init__(self) -> None:
        super().__init__("dist_sync")


def register() -> None:
    """Register the ``commsched`` KVStore type (done by ``import commsched.plugins.mxnet``)."""
    if mx.kv.KVStoreBase.kv_registry.get("commsched") is not Commsched:
        mx.kv.KVStoreBase.register(Commsched)
