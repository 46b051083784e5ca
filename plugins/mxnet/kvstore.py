"""A KVStore that schedules ps-lite push/pull by priority, in pieces, within a credit window.

An adapter over the core :class:`~commsched.Scheduler`. For each ``pushpull(i, grad)``
of ``trainer.step()``:

1. the key's sub-keys were fixed at ``init`` from :meth:`Scheduler.bounds`, and the
   gradient's memory got *piece avatars* (one NDArray per piece with an engine
   variable of its own, :func:`~commsched.plugins.mxnet.gate.avatar`), made once;
2. the gradient is *reserved* with the scheduler (:meth:`Scheduler.reserve`) on the
   caller's thread, so its step and, with ``ordering="fifo"``, its place in the
   order are the caller's;
3. an engine notifier reports when backward wrote it (``Ticket.ready``), and a
   *gate* queued right after holds the update and the next forward of that layer
   inside the engine until the pieces landed; the Python thread is not blocked;
4. the scheduler starts pieces by priority within the credit; each is a
   ``pushpull`` of its sub-key (:class:`~commsched.plugins.mxnet.backends.KVStoreBackend`).

With ``ordering="planned"`` (``config.plan``) the order and the piece sizes are the plan's:
every worker loads the plan and agrees on its digest at construction, and checks it
against the initialized keys (names ``str(key)``, sizes, shapes, dtypes) at the first
``pushpull``, agreeing again, before any piece starts (:mod:`commsched.plan_agreement`
over the order store: ``PlanMismatch`` on every worker otherwise); each key's sub-keys are
cut at its plan group's piece size, and ``PlannedPolicy`` starts them in the plan's order.
ps-lite has no two-level algorithm: pieces planned ``"hierarchical"`` are plain push/pull
(a warning says so); fused groups are refused (a key is one array on the servers).

Why the order must be agreed, what ``update_on_kvstore=True`` loses, and the
limits: docs/mxnet.md in the project.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import mxnet as mx
import numpy as np

from commsched.config import SchedulerConfig, check_config, check_layer_priority
from commsched.errors import CommschedTimeout, OrderAgreementError, SchedulerClosed
from commsched.lifecycle import Closeable, close_at_exit
from commsched.partition import piece_bounds
from commsched.plan import Plan, PlanMismatch, PlannedTensor
from commsched.plan_agreement import agree_on_plan, note_engine, store_gather
from commsched.policy import agrees_on_order
from commsched.scheduler import Scheduler
from commsched.tcpstore import StoreClient, StoreServer
from commsched.plugins.mxnet import gate as gate_mod
from commsched.plugins.mxnet.backends import (FIRST_SUB_KEY, KVStoreBackend, allocate_sub_keys, order_store,
                                              server_count, sync_kvstore)
from commsched.plugins.mxnet.tensor_ops import (KeyEntry, Transfer, TransferOps, as_list, check_array, key_items,
                                                single)
from commsched.plugins.mxnet.timing import StepTimes, format_report, pslite_comm_s

__all__ = ["FIRST_SUB_KEY", "Commsched", "Dist_Commsched", "KVStore", "register"]

log = logging.getLogger(__name__)

_GATE_MODES = ("auto", "engine", "issue")
_LOOK_S = 0.5  # how often the fallback's wait for its pieces to be issued looks for errors


class KVStore(Closeable, mx.kv.KVStoreBase):
    """A Gluon-compatible KVStore whose push/pull is scheduled by commsched.

    Args:
        kvstore: the ps-lite KVStore to drive: a type name (``"dist_sync"``,
            ``"dist_device_sync"``; ``"local"`` for one process) or an existing
            ``mx.kv.KVStore``. Asynchronous types are refused.
        config: scheduler settings; default ``SchedulerConfig()`` (``COMMSCHED_*``
            environment variables, then defaults).
        update_on_kvstore: allow ``Trainer(update_on_kvstore=True)``: the servers then
            run the optimizer on each piece (sub-key); elementwise optimizers give
            the same numbers, but index-keyed ``lr_mult``/``wd_mult`` and whole-array
            optimizers (LARS, LAMB) do not fit. Default False: the Trainer updates
            locally, as it does when a KVStore cannot hold an optimizer.
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
    instead of hanging the engine. A closed store raises ``SchedulerClosed``.
    """

    def __init__(self, kvstore: str | mx.kv.KVStore = "dist_sync", config: SchedulerConfig | None = None, *,
                 update_on_kvstore: bool = False, gate: str = "auto") -> None:
        # every argument is checked before a ps-lite store, a TCP store or a thread exists
        check_config(config)
        if not isinstance(kvstore, (str, mx.kv.KVStore)):
            raise TypeError(f"kvstore must be a KVStore type name such as 'dist_sync' or an mx.kv.KVStore, "
                            f"got {type(kvstore).__name__}")
        if not isinstance(update_on_kvstore, bool):
            raise TypeError(f"update_on_kvstore={update_on_kvstore!r} must be True (the servers run the optimizer) "
                            "or False (the workers do)")
        if not isinstance(gate, str) or gate not in _GATE_MODES:
            raise ValueError(f"gate={gate!r} is not one of {', '.join(_GATE_MODES)}")
        self.config = config if config is not None else SchedulerConfig()
        check_layer_priority(self.config, "the MXNet KVStore")
        if gate == "engine" and not gate_mod.available():
            raise ValueError("gate='engine' needs MXEnginePushAsyncND in libmxnet, which this build lacks; "
                             "use gate='auto' or 'issue'")
        self._gate_mode = "engine" if gate == "auto" and gate_mod.available() else ("issue" if gate == "auto" else gate)
        planned = self.config.ordering == "planned"
        if planned:
            _check_planned(self.config, self._gate_mode)
        #: with ``ordering="planned"``: the :class:`commsched.plan.Plan` every worker agreed on
        self.plan: Plan | None = None
        self._model_checked = False
        self._inner = inner = sync_kvstore(kvstore)
        self._server_update = bool(update_on_kvstore)
        self._gates = gate_mod.Gates() if self._gate_mode == "engine" else None
        self._backend = KVStoreBackend(inner, self._gates)
        self._times = self._backend.times = StepTimes()  # the moments report() summarizes
        self._transfer_ids = itertools.count()
        self._entries: dict[Any, KeyEntry] = {}
        self._seen: set = set()  # keys of the current step (the Trainer communicates each key once per step)
        self._outstanding: set[Future] = set()  # futures of pushpulls whose result has not landed
        self._closed = False
        self._store_server: StoreServer | None = None
        self._store: StoreClient | None = None
        try:
            if agrees_on_order(self.config, self._backend.world_size, self._backend.negotiates_order) or (
                    planned and self._backend.world_size > 1):  # planned: the plan checks and aborts travel
                self._store_server, self._store = order_store(inner)
            if planned:
                self._start_plan()
            self._scheduler = Scheduler(self._backend, TransferOps(), self.config, store=self._store,
                                        key_prefix="commsched-mx")
        except BaseException:
            self._backend.close()
            self._release()
            raise
        self._watchdog = None if self._gates is None else gate_mod.Watchdog(self._gates, self._scheduler,
                                                                            self.config.timeout_s)
        close_at_exit(self, min(self.config.timeout_s, 30.0))  # before MXNet shuts its engine down

    # ------------------------------------------------------------ KVStoreBase
    @property
    def type(self) -> str:
        """The wrapped store's type (contains 'dist' for ps-lite stores, as the Trainer expects)."""
        return self._inner.type

    @property
    def rank(self) -> int:
        """This worker's rank, 0..num_workers-1."""
        return self._backend.rank

    @property
    def num_workers(self) -> int:
        """The number of workers."""
        return self._backend.world_size

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
        sub_keys: list[int] = []
        sub_values: list[mx.nd.NDArray] = []
        for k, v, _ in key_items(key, value):
            v = single(k, v, "value")
            entry = self._register(k, v)
            sub_keys += entry.sub_keys
            sub_values += entry.views(v)
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
        self.pull(key, out, priority)
        for _, o, _ in key_items(key, out):
            for target in as_list(o):
                target.wait_to_read()

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Sum ``value`` over the workers (or, with ``update_on_kvstore``, push it to the
        servers' optimizer) and put the result in ``out`` (default: ``value`` itself).

        Returns at once. Whatever MXNet queues later on the result waits for it inside
        the engine; ``priority`` follows MXNet (higher is more urgent; the Trainer
        passes ``-index``, so layer 0 goes first).
        """
        self._check_usable()
        for k, v, o in key_items(key, value, out):
            self._pushpull_one(k, v, o, priority)

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Push without scheduling (ps-lite order); for code that calls push and pull itself."""
        self._check_usable()
        for k, v, _ in key_items(key, value):
            v = single(k, v, "value")
            entry = self._entry(k, v)
            self._inner.push(entry.sub_keys, entry.views(v), priority=priority)

    def pull(self, key: Any, out: Any = None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Pull without scheduling; see :meth:`push`."""
        self._check_usable()
        for k, o, _ in key_items(key, out):
            for target in as_list(o):
                check_array(k, target)
                entry = self._entry(k, target)
                self._inner.pull(entry.sub_keys, out=entry.views(target), priority=priority)

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
        indexed = [name for name in ("idx2name", "lr_mult", "wd_mult") if getattr(optimizer, name, None)]
        if indexed:
            log.warning("update_on_kvstore=True: the servers see commsched sub-keys, not parameter indices, so "
                        "the optimizer's %s are ignored there; use update_on_kvstore=False to keep them",
                        ", ".join(indexed))
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
        self._inner.save_optimizer_states(fname, dump_optimizer=dump_optimizer)

    def load_optimizer_states(self, fname: str) -> None:
        """Load optimizer states saved by :meth:`save_optimizer_states`."""
        self._check_states()
        self._inner.load_optimizer_states(fname)

    def _check_states(self) -> None:
        if "dist" in self.type:
            raise ValueError("with update_on_kvstore=True the optimizer states live on the parameter servers, "
                             "which cannot save or load them (plain dist_sync cannot either); train with "
                             "update_on_kvstore=False, the default, and use Trainer.save_states/load_states")
        self.synchronize()

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
        self._scheduler.synchronize(timeout)

    def outstanding(self) -> int:
        """How many ``pushpull`` results have not landed yet (waiting for backward, queued or in flight)."""
        return len(self._outstanding)

    def stats(self) -> dict:
        """The scheduler's counters (pieces, bytes, order per step, ...)."""
        return self._scheduler.stats()

    def report_numbers(self, topology: Any = None) -> dict:
        """The figures of :meth:`report`, as a dict (``None`` where a figure was not measured).

        Means over the last complete steps kept (up to 20; step 0, which holds the initial
        broadcast, left out): ``step_s``, ``first_layer_wait_s``, ``tail_s``, ``blocked_s``,
        ``comm_busy_s``, ``busy_in_backward_s``, ``bytes_per_step``, ``pieces_per_step``,
        ``payload_bandwidth_bytes_s``, ``goodput_bytes_s`` (see
        :mod:`commsched.plugins.mxnet.timing`); ``settings``; with ``topology``,
        ``expected_comm_s``.
        """
        stats = self._scheduler.stats()
        distributed = "dist" in self.type
        servers = server_count() if distributed else None
        out = self._times.summary(self._gate_mode)
        out["steps"] = stats["steps"] + (1 if self._seen else 0)  # the current step has not been ended yet
        out["settings"] = {"ordering": stats["ordering"], "partition_bytes": stats["partition_bytes"],
                           "credit_bytes": stats["credit_bytes"], "gate": self._gate_mode,
                           "update_on_kvstore": self._server_update, "workers": self.num_workers,
                           "servers": servers if servers is not None else ("unknown" if distributed else "none"),
                           "kvstore": self.type}
        out.update(expected_comm_s=None, topology=None, servers=servers)
        if topology is not None:
            from commsched.costmodel.topology import Topology

            if not isinstance(topology, Topology):
                raise TypeError(f"topology must be a commsched.costmodel.Topology (Topology.from_json('topo.json'), "
                                f"Topology.described(...)), not {type(topology).__name__}")
            if topology.world_size != self.num_workers:
                raise ValueError(f"the topology has {topology.world_size} ranks and this job {self.num_workers} "
                                 "workers; describe the workers' machines (the servers are modelled on nodes of "
                                 "their own)")
            if servers is None:
                raise ValueError("the number of ps-lite servers is unknown (DMLC_NUM_SERVER is not set): the "
                                 "expected time needs it; start the job with DMLC_NUM_SERVER set, as dmlc's "
                                 "launch.py and commsched launch do")
            out["topology"] = topology.describe()
            if out["bytes_per_step"] is not None:
                out["expected_comm_s"] = pslite_comm_s(topology, out["bytes_per_step"], out["pieces_per_step"],
                                                       servers)
        return out

    def report(self, topology: Any = None) -> str:
        """A short summary of the training so far, as text (print or log it).

        Per step: the time the next forward's first layer waited in its engine gate past
        the end of backward, how long communication went on after backward, bytes and pieces,
        the time pieces were in flight and the bandwidth that gives, goodput, the settings in
        use; with ``topology`` (a :class:`commsched.costmodel.Topology`, e.g. from
        ``commsched probe``) also ps-lite's expected push and pull time. What the KVStore
        cannot measure (the next forward's own operations; with ``gate="issue"`` the
        engine's wait) is said, not printed as zero. Figures as a dict: :meth:`report_numbers`.
        """
        return format_report(self.report_numbers(topology))

    def close(self, timeout: float | None = None) -> None:
        """Finish pending transfers (at most ``timeout``), open every gate, stop every thread. Idempotent.

        Raises the error that failed this store, if one did, else a drain timeout.
        """
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.close()
        try:
            self._scheduler.close(timeout)  # also closes the backend
        finally:
            self._release()
        if self._scheduler.error is not None:  # the first error says more than a drain timeout after it
            raise self._scheduler.error

    # ------------------------------------------------------------- internals
    def _check_usable(self) -> None:
        if self._closed:
            raise SchedulerClosed("this commsched KVStore is closed; create a new one")
        self._scheduler.check()

    def _register(self, key: Any, array: mx.nd.NDArray) -> KeyEntry:
        if key in self._entries:
            raise ValueError(f"key {key!r} is already initialized in this KVStore")
        if self._entries and isinstance(key, str) != isinstance(next(iter(self._entries)), str):
            raise ValueError(f"key {key!r}: keys must be all int or all str, as in MXNet")
        size, itemsize = int(array.size), int(np.dtype(array.dtype).itemsize)
        if self.plan is None:
            bounds = self._scheduler.bounds(size, itemsize)
        else:
            if self._model_checked:
                raise PlanMismatch(f"key {key!r} is initialized after the plan was checked against the model (at the "
                                   "first pushpull); initialize every key before training")
            try:  # the plan group's piece size
                bounds = self._scheduler.bounds(size, itemsize, str(key))
            except OrderAgreementError:  # not in the plan: the first pushpull's check names it, on every worker
                bounds = piece_bounds(size, itemsize, self.config.partition_bytes)
        entry = self._entries[key] = KeyEntry(key, array, bounds, allocate_sub_keys(self._inner, len(bounds)))
        return entry

    def _entry(self, key: Any, array: mx.nd.NDArray) -> KeyEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise ValueError(f"key {key!r} was not initialized; call init() or broadcast() first "
                             "(gluon.Trainer does this itself)")
        entry.check(array, "the array")
        return entry

    def _start_plan(self) -> None:
        """``ordering="planned"``, at construction: load the plan, check the world, agree on the digest
        with every worker (``PlanMismatch`` on all of them otherwise); refuse fused groups."""
        source = self.config.plan
        rank, world = self._backend.rank, self._backend.world_size
        try:
            found: Plan | BaseException = source if isinstance(source, Plan) else Plan.from_json(str(source))
            found.check_world(world)
        except (ValueError, OSError) as exc:  # PlanMismatch is a ValueError too
            found = exc
        gather = None if world == 1 else self._gather("commsched-mx/plan")
        plan = agree_on_plan(found, rank=rank, world_size=world, gather=gather,
                             source=source if isinstance(source, str) else None)
        note_engine(plan, "MXNet has no DDP reducer")
        fused = [g.name for g in plan.groups if g.fused]
        if fused:
            raise ValueError(f"the plan fuses small tensors into {len(fused)} group(s) ({fused[:3]}); the commsched "
                             "KVStore cannot (a ps-lite key is one array on the servers). Make the plan without "
                             "fusion: `commsched plan ... --fusions-mb 0 --reducer-mb none`")
        hierarchical = sum(p.algorithm == "hierarchical" for p in plan.pieces)
        if hierarchical:
            log.warning("the plan (digest %s) has %d piece(s) planned 'hierarchical'; ps-lite has no two-level "
                        "algorithm, so they are plain push/pull to the servers (order and piece sizes as planned)",
                        plan.digest[:12], hierarchical)
        self.plan = plan
        self.config = dataclasses.replace(self.config, plan=plan, credit_bytes=plan.credit_bytes)

    def _gather(self, prefix: str) -> Any:
        """:func:`~commsched.plan_agreement.store_gather` on the order store, and then worker 0, which
        serves that store, waits until every worker has read every post: a worker that raises (and
        closes) right after its own reads would otherwise cut the others off mid-read."""
        rank, world, timeout = self._backend.rank, self._backend.world_size, self.config.timeout_s
        inner = store_gather(self._store, prefix, rank, world, timeout)

        def gather(mine: dict) -> list[dict]:
            posted = inner(mine)
            try:
                self._store.set(f"{prefix}/read/{rank}", b"1")
            except ConnectionError:
                if self._store_server is not None:
                    raise
                # This worker has every post, so the outcome is decided. Worker 0 may
                # close its store (raising what the posts say) as soon as it has this
                # mark, before the reply to it is sent; a lost reply changes nothing.
                log.debug("the order store closed after this worker's read mark", exc_info=True)
            if self._store_server is not None:
                deadline = time.monotonic() + timeout
                for other in range(world):
                    try:
                        self._store.get(f"{prefix}/read/{other}", max(0.001, deadline - time.monotonic()))
                    except TimeoutError:
                        raise CommschedTimeout(f"worker 0 waiting for worker {other} to read the plan checks",
                                               timeout) from None
            return posted
        return gather

    def _check_model(self) -> None:
        """At the first pushpull: the plan against every initialized key, agreed by every worker."""
        self._model_checked = True
        entries = [PlannedTensor(str(k), e.size, int(e.dtype.itemsize), e.shape, e.dtype.name)
                   for k, e in self._entries.items()]
        found: Plan | BaseException = self.plan
        try:
            self.plan.check_model(entries)
        except PlanMismatch as exc:
            found = PlanMismatch(f"{exc} (the commsched KVStore names a tensor str(key); gluon.Trainer's keys are "
                                 "the indices of its parameters: list them with commsched.plugins.mxnet.plan_model("
                                 "trainer_params))")
        world = self._backend.world_size
        gather = None if world == 1 else self._gather("commsched-mx/model")
        try:
            agree_on_plan(found, rank=self._backend.rank, world_size=world, gather=gather)
        except BaseException as exc:
            self._scheduler.abort(exc)  # every later call raises it too
            raise

    def _pushpull_one(self, key: Any, value: Any, out: Any, priority: int) -> None:
        if self.plan is not None and not self._model_checked:
            self._check_model()
        value = single(key, value, "value")
        entry = self._entry(key, value)
        target = None if out is None else single(key, out, "out")
        if target is not None:
            entry.check(target, "out")
        target = None if target is value else target
        if key in self._seen:  # a key seen again starts the next step
            self._scheduler.mark_step()
            self._seen = set()
        self._seen.add(key)
        if entry.size == 0:
            return
        # Engine gates need pieces with engine variables of their own ("avatars"):
        # pieces then travel independently, and the gated array's variable stays free.
        transfer, staging = entry.prepare(value, target, gate_mod.avatar if self._gates is not None else None)
        if self._gates is None:
            self._issue_and_wait(transfer, -int(priority))
            return
        ticket = self._scheduler.reserve(transfer.name, priority=-int(priority))
        self._outstanding.add(ticket.future)
        step, tid = ticket.task.step, next(self._transfer_ids)
        self._times.reserved(step, tid, -int(priority))
        try:
            # The notifier reads `staging` before the gate writes it, so it fires when
            # backward (or the copy into the push buffer) finished, never later.
            self._gates.notify(staging, functools.partial(self._ready, ticket, transfer, step, tid))
            gate = self._gates.gate(staging if target is None else target, transfer.name)
        except BaseException as exc:
            self._scheduler.abort(exc)
            raise
        ticket.future.add_done_callback(functools.partial(self._landed, gate, step, tid))

    def _ready(self, ticket: Any, transfer: Transfer, step: int, tid: int) -> None:
        # Engine thread, from the notifier: backward wrote the gradient. Never raises.
        self._times.ready(step, tid, time.monotonic())
        ticket.ready(transfer)

    def _issue_and_wait(self, transfer: Transfer, priority: int) -> None:
        # Fallback without engine gates: return once every piece was issued, so that
        # what the caller queues next (the update) is ordered after the pulls.
        issued = threading.Event()
        transfer.on_issued = issued.set
        start = time.monotonic()
        step, tid = self._scheduler.step, next(self._transfer_ids)  # the step this submit joins
        self._times.reserved(step, tid, priority)
        future = self._scheduler.submit(transfer.name, transfer, priority=priority)
        self._outstanding.add(future)
        future.add_done_callback(functools.partial(self._landed, None, step, tid))
        deadline = start + self.config.timeout_s
        while not issued.wait(_LOOK_S):
            self._scheduler.check()
            if time.monotonic() > deadline:
                raise CommschedTimeout(f"issuing the pieces of key {transfer.name!r}", self.config.timeout_s,
                                       self._scheduler.pending())
        self._times.blocked(step, time.monotonic() - start)

    def _landed(self, gate: gate_mod.Gate | None, step: int, tid: int, future: Future) -> None:
        # Completion thread (or the caller's, if already done): opening gates calls the engine.
        self._times.landed(step, tid, time.monotonic())
        self._outstanding.discard(future)
        if gate is not None:
            gate.open()
        if future.exception() is not None and self._gates is not None:
            self._gates.open_all()  # failed: let the engine and the user's forward go on; the next call raises

    def _release(self) -> None:
        opened = self._gates.open_all() if self._gates is not None else 0
        if opened:
            log.warning("closed a commsched KVStore with %d gate(s) still closed; opened them", opened)
        for closable in (self._store, self._store_server):
            if closable is not None:
                closable.close()


def _check_planned(config: SchedulerConfig, gate_mode: str) -> None:
    """What ``ordering="planned"`` needs here, checked before any store or thread exists."""
    if config.plan is None:
        raise ValueError("ordering='planned' on the MXNet KVStore needs a plan: SchedulerConfig(ordering='planned', "
                         "plan='plan.json') (make one with `commsched plan ... --fusions-mb 0`); planning in-process "
                         "from the first steps is not supported here")
    if gate_mode != "engine":
        raise ValueError("ordering='planned' on the MXNet KVStore needs the engine gate (gate='engine' or 'auto' on a "
                         "libmxnet with MXEnginePushAsyncND): with gate='issue' pushpull waits until its own pieces "
                         "started, and the plan may start another key's first; use ordering='dynamic' with "
                         "gate='issue'")


class Commsched(KVStore):
    """The registered KVStore type: ``mx.kv.create("commsched")`` is ``KVStore("dist_sync")``
    with settings from the ``COMMSCHED_*`` environment."""

    def __init__(self) -> None:
        super().__init__("dist_sync")


class Dist_Commsched(Commsched):  # noqa: N801  (MXNet registers a type under its class name, lower-cased)
    """``kvstore="dist_commsched"``: the same store under a name Gluon keeps.

    ``gluon.Trainer(..., kvstore=<a string>)`` on a worker with one context creates the
    store only when the string contains ``"dist"`` (MXNet 1.9.1, ``model._create_kvstore``);
    otherwise it trains without any KVStore, each worker alone, silently. So a string
    passed to the Trainer must be ``"dist_commsched"``; ``mx.kv.create("commsched")`` and
    the object passed as ``kvstore=`` work under either name.
    """


def register() -> None:
    """Register the ``commsched`` and ``dist_commsched`` KVStore types (done by ``import commsched.plugins.mxnet``)."""
    for name, klass in (("commsched", Commsched), ("dist_commsched", Dist_Commsched)):
        if mx.kv.KVStoreBase.kv_registry.get(name) is not klass:
            mx.kv.KVStoreBase.register(klass)
