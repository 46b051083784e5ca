"""Collective engines for the torch plugin: torch.distributed (default) and Horovod.

* :class:`TorchBackend` runs each piece as an asynchronous ``torch.distributed.all_reduce``
  on a process group of its own (gloo on CPU, NCCL on GPU), or, for a piece whose
  ``algorithm`` is ``"hierarchical"`` once :meth:`TorchBackend.use_hierarchical` was
  called, by the two-level algorithm of ``hierarchical.py``; :class:`C10dStore` adapts
  the process group's rendezvous store to :class:`commsched.store.Store` for order agreement.
* :class:`HorovodBackend` (``backend="horovod"``) runs each piece as
  ``hvd.allreduce_async_``. Horovod matches operations across ranks by name through
  its rank-0 coordinator, so ranks may issue pieces in different orders: only rank 0
  paces by priority and credit, the other ranks issue each piece as soon as it is
  ready (``negotiates_order = True``). Pieces keep stable, unique names
  (``commsched.<parameter>#<piece>``). Horovod's tensor fusion may merge pieces that
  are ready in the same cycle (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``);
  see docs/horovod.md for how that interacts with partition and credit.

Both offer ``broadcast(tensor, root)`` and ``broadcast_object(obj, root)`` for the
optimizer's initial broadcast, and an idempotent ``close()`` that the scheduler calls.
"""

from __future__ import annotations

import collections
import datetime
import logging
import pickle
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from commsched.errors import CommschedError, CommschedTimeout, CommunicationError, HorovodUnavailable
from commsched.plugins.torch.cuda import CudaTask, DeviceStreams
from commsched.plugins.torch.hierarchical import HierarchicalAllReduce

__all__ = ["BACKENDS", "C10dStore", "HorovodBackend", "TorchBackend", "default_store", "make_backend",
           "resolve_backend"]

log = logging.getLogger(__name__)

BACKENDS = ("torch", "horovod")
#: What ``backend=`` accepts: a name of :data:`BACKENDS`, or ``"auto"``.
CHOICES = ("auto",) + BACKENDS
# How often the CUDA completion thread looks at the oldest piece's event: from _POLL_MIN_S,
# doubling while it is not done, up to _POLL_MAX_S (the most a completion is noticed late).
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 1e-3


class C10dStore:
    """:class:`commsched.store.Store` over a ``torch.distributed.Store`` (c10d's calls release the GIL)."""

    def __init__(self, store: "dist.Store") -> None:
        self._store = store
        self._popper: Optional["dist.Store"] = None
        self._popper_timeout: Optional[float] = None
        self._getters = threading.local()  # per thread: a connection whose timeout bounds its get

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        # c10d's get of a missing key blocks for the store's own timeout (minutes), holding its
        # connection: a key deleted between wait and get (the last rank to close cleans up while
        # a completion thread reads the abort notice) hung the caller and every call queued behind
        # it. So each thread reads through its own clone whose timeout is this call's.
        local = self._getters
        if getattr(local, "store", None) is None:
            local.store, local.timeout = self._store.clone(), None
        if local.timeout != timeout_s:
            local.store.set_timeout(datetime.timedelta(seconds=timeout_s))
            local.timeout = timeout_s
        try:
            local.store.wait([key], datetime.timedelta(seconds=timeout_s))
            return bytes(local.store.get(key))
        except Exception as exc:  # c10d raises DistStoreError/RuntimeError; only a timeout is a TimeoutError
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise TimeoutError(str(exc)) from None
            raise

    def check(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def delete(self, key: str) -> None:
        self._store.delete_key(key)  # c10d's queues are not keys: a popped-empty queue holds nothing

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, int(amount)))

    def push(self, queue: str, value: bytes) -> None:
        self._store.queue_push(queue, value)

    def pop(self, queue: str, timeout_s: float) -> bytes:
        # A blocking pop holds its connection: give it one of its own, so the other
        # threads' calls do not queue behind it.
        if self._popper is None:
            self._popper = self._store.clone()
        if self._popper_timeout != timeout_s:
            self._popper.set_timeout(datetime.timedelta(seconds=timeout_s))
            self._popper_timeout = timeout_s
        try:
            return bytes(self._popper.queue_pop(queue))
        except Exception as exc:
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise TimeoutError(str(exc)) from None
            raise


def default_store() -> C10dStore:
    """The default process group's store (the one ``init_process_group`` rendezvoused on)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # private API: fail with a clear message if it moves
        raise CommschedError(
            "commsched could not reach the default process group's store for order agreement "
            f"({exc!r}); call torch.distributed.init_process_group(...) first, or use ordering='fifo'"
        ) from exc
    return C10dStore(store)


def own_group(timeout_s: float, like: Optional["dist.ProcessGroup"] = None) -> "dist.ProcessGroup":
    """A new process group over the default group's ranks (every rank must call it, in one order), or
    over the ranks of ``like`` (a user's ``process_group``: only its ranks call it, in one order). On
    gloo its waits end after ``timeout_s``: a peer that died mid-collective cannot hold a gloo thread,
    nor the group's teardown, for the default group's timeout (30 min unless the user set one). NCCL
    keeps the user's: its watchdog would abort the process instead."""
    backend = dist.get_backend(like)  # like=None: the default group's
    options = {"timeout": datetime.timedelta(seconds=timeout_s)} if backend == "gloo" else {}
    if like is not None:
        return dist.new_group(dist.get_process_group_ranks(like), backend=backend, use_local_synchronization=True,
                              **options)
    return dist.new_group(backend=backend, **options)


class TorchBackend:
    """Pieces as asynchronous sum all-reduces on a torch.distributed process group.

    A task whose ``ready`` is a :class:`commsched.plugins.torch.cuda.CudaTask` (CUDA tensors)
    takes the stream/event path (see ``cuda.py``): the all-reduce is issued on a
    communication stream after the task's ready event, and ``done`` is called only when the
    piece's completion event has completed on the GPU, so credit is held for as long as the
    collective really runs (NCCL's future completes when the all-reduce is merely queued).
    Completions are watched by one named thread (``commsched-cuda-r<rank>``, started with the
    first such piece) that polls the oldest piece's event with ``event.query()``: pieces on one
    stream finish in issue order, so only the head is polled, with a back-off from 50 us to
    1 ms. Why a poll and not ``event.synchronize()``: a blocking ``cudaEventSynchronize`` cannot
    be interrupted when a peer dies mid-collective (the kernel never ends), so ``close()``
    could not stop the thread; a poll stops within a millisecond and bounds close by
    ``timeout_s``. The thread never calls NCCL: only the dispatch thread drives the group.
    Tensors on the CPU (gloo) take the plain path: ``done`` from the work's future.
    """

    negotiates_order = False

    def __init__(self, group: Optional["dist.ProcessGroup"] = None, *, timeout_s: float = 30.0,
                 device_streams: Optional[DeviceStreams] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "backend='torch' needs an initialized default process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') before creating DistributedOptimizer"
            )
        self.timeout_s = float(timeout_s)
        #: the user's ``process_group`` (None: the default group's ranks)
        self.user_group = group
        # A group of our own, over the default group's ranks or the user's group's: collectives the user
        # issues on that group while pieces are still in flight (cross-iteration) cannot interleave with
        # ours in a different order on different ranks.
        self.group = own_group(self.timeout_s, like=group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        #: the stream/event operations (a :class:`FakeCuda` one in tests); real ones are made lazily
        self.device_streams = device_streams
        self._inflight: collections.deque = collections.deque()  # (completion event, done, error box)
        self._cv = threading.Condition()
        self._closing = False
        self._watcher: Optional[threading.Thread] = None
        self._hierarchical: Optional[HierarchicalAllReduce] = None
        self._every_piece_hierarchical = False

    def use_hierarchical(self, nodes: int, ranks_per_node: int, *, every_piece: bool = False) -> None:
        """Reduce pieces whose ``algorithm`` is ``"hierarchical"`` (every piece with ``every_piece``)
        by the two-level algorithm on ``nodes`` x ``ranks_per_node`` node-major ranks
        (:class:`commsched.plugins.torch.hierarchical.HierarchicalAllReduce`). Creates process
        groups: every rank must call it, with the same arguments, before the first piece. On one
        node or one rank per node, or on CUDA tensors (the stream path is unchanged), pieces take
        the plain all-reduce."""
        if dist.get_world_size(self.group) != dist.get_world_size():
            raise ValueError("the hierarchical all-reduce runs on the default group's ranks; leave "
                             "process_group=None to use it")
        if self._hierarchical is not None:
            # a later plan on the same engine (ordering="auto" returning to a planned start): the same
            # process groups serve it; other shapes would need groups made again on every rank
            first = self._hierarchical
            if (nodes, ranks_per_node, bool(every_piece)) == (first.nodes, first.ranks_per_node,
                                                              self._every_piece_hierarchical):
                return
            raise ValueError("use_hierarchical() was called twice on this backend with different arguments "
                             f"({nodes}x{ranks_per_node}, every_piece={every_piece}; first "
                             f"{first.nodes}x{first.ranks_per_node})")
        self._hierarchical = HierarchicalAllReduce(nodes, ranks_per_node, timeout_s=self.timeout_s)
        self._every_piece_hierarchical = bool(every_piece)

    @property
    def starts_in_done(self) -> bool:
        """Whether the thread that calls a piece's ``done`` may start the next piece
        (``SchedulerConfig.direct_start``): gloo's completion callbacks may, so while no piece took the
        stream/event path (whose watcher never drives the group) or the two-level algorithm."""
        return self.device_streams is None and self._hierarchical is None

    @property
    def hierarchical(self) -> Optional[HierarchicalAllReduce]:
        """The two-level all-reduce in use (see :meth:`use_hierarchical`), or None."""
        return self._hierarchical

    def streams_for(self, tensor: torch.Tensor) -> Optional[DeviceStreams]:
        """The :class:`DeviceStreams` for ``tensor`` if it takes the stream/event path (CUDA, or
        any tensor under a fake), else None."""
        if self.device_streams is not None and (tensor.is_cuda or self.device_streams.fake):
            return self.device_streams
        if tensor.is_cuda:
            with self._cv:
                if self.device_streams is None:
                    self.device_streams = DeviceStreams()
            return self.device_streams
        return None

    def start(self, piece, done: Callable[[Optional[BaseException]], None]) -> None:
        if not dist.is_initialized():
            raise CommschedError(
                "the torch.distributed process group was destroyed while commsched still had pieces to "
                "reduce; call opt.synchronize() and opt.close() before destroy_process_group()"
            )
        view = piece.view
        record = piece.task.ready
        if isinstance(record, CudaTask):
            self._start_on_stream(piece, record, done)
            return
        two_level = self._hierarchical
        if two_level is not None and not two_level.flat and (
                self._every_piece_hierarchical or getattr(piece, "algorithm", "ring") == "hierarchical"):
            two_level.start(view, done, piece.name, getattr(piece.task, "step", None))
            return
        work = dist.all_reduce(view, group=self.group, async_op=True)

        def finished(fut: "torch.futures.Future") -> None:
            try:
                fut.value()
            except BaseException as exc:
                done(exc)
                return
            done(None)

        work.get_future().add_done_callback(finished)

    def _start_on_stream(self, piece: Any, record: CudaTask,
                         done: Callable[[Optional[BaseException]], None]) -> None:
        """Dispatch thread: issue ``piece`` on the communication stream; the watcher calls ``done``."""
        streams = record.streams
        group = self.group
        work, completion = streams.start_on_comm_stream(
            piece.view, record.ready_event, lambda: dist.all_reduce(piece.view, group=group, async_op=True))
        errors: list[BaseException] = []

        def failed(fut: "torch.futures.Future") -> None:  # NCCL reports errors (not completion) here
            try:
                fut.value()
            except BaseException as exc:
                errors.append(exc)
                with self._cv:
                    self._cv.notify()

        work.get_future().add_done_callback(failed)
        piece.task.handles.append(completion)
        record.issued(piece.task.tensor, len(piece.task.pieces))
        with self._cv:
            if self._closing:
                raise CommschedError("this torch backend is closed; create a new DistributedOptimizer")
            self._inflight.append((completion, done, errors))
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name=f"commsched-cuda-r{self.rank}",
                                                 daemon=False)
                self._watcher.start()
            self._cv.notify()

    def _watch(self) -> None:
        """Completion thread of the stream/event path: ``done`` once the oldest piece's event completed."""
        delay = _POLL_MIN_S
        while True:
            with self._cv:
                while not self._inflight and not self._closing:
                    self._cv.wait()
                if not self._inflight:
                    return
                completion, done, errors = self._inflight[0]
                streams = self.device_streams
            try:
                finished = bool(errors) or streams.is_done(completion)
            except BaseException as exc:  # a CUDA error (illegal access, aborted communicator)
                errors.append(exc)
                finished = True
            if finished:
                with self._cv:
                    self._inflight.popleft()
                done(errors[0] if errors else None)
                delay = _POLL_MIN_S
                continue
            with self._cv:
                if self._closing and time.monotonic() >= self._close_deadline:
                    left, self._inflight = list(self._inflight), collections.deque()
                else:
                    left = None
                    self._cv.wait(delay)
            if left is not None:
                error = CommschedError(f"{len(left)} piece(s) did not finish on the GPU within {self.timeout_s:.0f} "
                                       "s of close(); a peer may have died mid-collective")
                for _, each_done, _ in left:
                    each_done(error)
                return
            delay = min(delay * 2, _POLL_MAX_S)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrite ``tensor`` with rank ``root``'s (a rank of our group, as :attr:`rank` counts), in place."""
        dist.broadcast(tensor, group=self._open_group(), group_src=root)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Group rank ``root``'s ``obj`` (picklable), on every rank."""
        payload = [obj]
        dist.broadcast_object_list(payload, group=self._open_group(), group_src=root)
        return payload[0]

    def _open_group(self) -> "dist.ProcessGroup":
        if self.group is None:
            raise CommschedError("this torch backend is closed; create a new DistributedOptimizer")
        return self.group

    def close(self) -> None:
        """Destroy the group we created (a group the user passed stays theirs), now
        rather than during interpreter teardown, where gloo's threads can abort the
        process ("terminate called without an active exception"). Idempotent."""
        with self._cv:
            self._closing = True
            self._close_deadline = time.monotonic() + self.timeout_s
            self._cv.notify()
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(self.timeout_s + 1.0)
        if self._hierarchical is not None:
            self._hierarchical.close()
        group, self.group = self.group, None
        if group is not None:
            destroy_own_group(group)


def all_gather_rows(ids: torch.Tensor, rows: torch.Tensor,
                    group: "dist.ProcessGroup") -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``ids`` and ``rows`` (any number of rows per rank) on ``group``, concatenated in rank
    order: a split tied embedding's rows (:mod:`commsched.plugins.torch.tied`; Horovod's counterpart is
    :meth:`HorovodBackend.all_gather_rows`). The counts go first, then ids and rows padded to the largest."""
    world = dist.get_world_size(group)
    count = torch.tensor([ids.numel()], dtype=torch.int64, device=ids.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    n = [int(c.item()) for c in counts]
    most = max(n)
    padded_ids = torch.zeros(most, dtype=ids.dtype, device=ids.device)
    padded_ids[:ids.numel()] = ids
    padded_rows = torch.zeros(most, rows.shape[1], dtype=rows.dtype, device=rows.device)
    padded_rows[:rows.shape[0]] = rows
    all_ids = [torch.empty_like(padded_ids) for _ in range(world)]
    all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
    dist.all_gather(all_ids, padded_ids, group=group)
    dist.all_gather(all_rows, padded_rows, group=group)
    return (torch.cat([a[:k] for a, k in zip(all_ids, n, strict=True)]),
            torch.cat([a[:k] for a, k in zip(all_rows, n, strict=True)]))


def destroy_own_group(group: "dist.ProcessGroup") -> None:
    """Destroy a group :func:`own_group` made, and this rank's rendezvous key of it."""
    if not dist.is_initialized():
        return
    name = dist.distributed_c10d._get_process_group_name(group)
    rank = dist.get_rank(group)
    dist.destroy_process_group(group)
    _delete_rendezvous_key(name, rank)


def _delete_rendezvous_key(group_name: str, rank: int) -> None:
    """Delete this rank's rendezvous key of the group ``group_name`` (``<name>/.../<rank>``, where
    gloo published its address) from the default store, so a closed optimizer leaves no key.

    Each rank deletes only its own: once this rank's group existed, every peer had read it
    (a gloo pair connects only after both sides read each other's address). Needs a store
    that lists its keys (TCPStore's extended API); best effort otherwise."""
    try:
        store = dist.distributed_c10d._get_default_store()
        keys = store.list_keys()
    except Exception:  # noqa: BLE001 - a store without list_keys (or gone): nothing to clean here
        return
    for key in keys:
        if key.startswith(f"{group_name}/") and key.endswith(f"/{rank}"):
            try:
                store.delete_key(key)
            except Exception as exc:  # noqa: BLE001 - the store's host may have exited first
                log.debug("could not delete rendezvous key %r: %r", key, exc)


def _import_horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise HorovodUnavailable(
            "backend='horovod' needs Horovod built with PyTorch support (horovod.torch); in the commsched "
            "repository `make horovod` builds and caches a patched Horovod 0.28.1 wheel, elsewhere install one "
            f"with HOROVOD_WITH_PYTORCH=1 (or use backend='torch'). Import failed: {exc}") from exc
    return hvd


class _HorovodTwoLevel:
    """The two-level algorithm's shape and this rank's two process sets (``HorovodBackend.use_hierarchical``)."""

    def __init__(self, nodes: int, ranks_per_node: int, every_piece: bool) -> None:
        self.nodes, self.ranks_per_node, self.every_piece = nodes, ranks_per_node, every_piece
        self.node_set: Any = None  # this node's ranks (None: flat, nothing two-level to do)
        self.cross_set: Any = None  # the ranks of this local rank, one per node
        self.pieces = 0  # pieces reduced by the two-level algorithm so far


class HorovodBackend:
    """Pieces as ``hvd.allreduce_async_`` sums (or averages, :meth:`average_in_engine`); a named waiter
    thread reports completions.

    Nothing here ever blocks in Horovod without a bound. Horovod offers no wait with a
    timeout (``hvd.synchronize`` waits for ever), and a handle can stay incomplete for
    ever: when a peer dies, Horovod's background loop stops and fails the operations in
    its queue, but one enqueued while it stops is never completed (the enqueue checks
    for shutdown before adding to the queue, the loop drains the queue in between). So:

    * the waiter thread (``commsched-horovod-r<rank>``, non-daemon) polls every handle in
      flight (``hvd.poll``, back-off 50 us to 1 ms) and calls ``hvd.synchronize`` only on
      one that is done. Once Horovod failed a handle, the engine is gone: any handle still
      incomplete ``LOST_GRACE_S`` later fails with a :class:`CommunicationError`. At
      :meth:`close`, handles still incomplete after ``timeout_s`` fail the same way and the
      thread ends, so the process can exit;
    * :meth:`broadcast`, :meth:`broadcast_object` and :meth:`all_gather_object` (the user's
      thread: the initial broadcast, plan agreement, agreed switches) issue asynchronous
      operations and wait at most ``timeout_s`` for each (:class:`CommschedTimeout`).
    """

    negotiates_order = True
    #: seconds a handle may stay incomplete after Horovod failed another one
    LOST_GRACE_S = 1.0

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = float(timeout_s)
        hvd = _import_horovod()
        if not hvd.is_initialized():
            hvd.init()
        self._hvd = hvd
        self.rank = hvd.rank()
        self.world_size = hvd.size()
        # (handle, done, name, then): then(result) starts a two-level piece's next phase (None: done)
        self._handles: list[tuple[Any, Callable[[Optional[BaseException]], None], str, Any]] = []
        self._cv = threading.Condition()
        self._closing = False
        self._close_deadline = 0.0
        self._broken: Optional[tuple[float, BaseException]] = None  # (when, Horovod's first error)
        self._collectives = 0  # object/tensor broadcasts and gathers so far (the same on every rank)
        self._op, self._prescale, self._postscale = hvd.Sum, 1.0, 1.0  # see average_in_engine
        self._two_level: Optional[_HorovodTwoLevel] = None  # see use_hierarchical
        self._thread = threading.Thread(target=self._wait_loop, name=f"commsched-horovod-r{self.rank}", daemon=False)
        self._thread.start()

    def average_in_engine(self, predivide: float = 1.0) -> bool:
        """From now on every piece is averaged by Horovod itself, as ``hvd.DistributedOptimizer(op=hvd.Average,
        gradient_predivide_factor=f)`` does: scaled by ``1/f`` before the sum and ``f/size`` after it, in
        Horovod's C++ loop over its fusion buffer, while the data is there. The optimizer then neither
        divides each gradient before submitting it nor each reduced tensor on the completion thread (a
        pass over every gradient in Python, twice with a predivide factor), and the result is bit for bit
        Horovod's own optimizer's. Returns True (the optimizer skips its own divisions)."""
        self._op, self._prescale, self._postscale = self._hvd.Average, 1.0 / float(predivide), float(predivide)
        return True

    def use_hierarchical(self, nodes: int, ranks_per_node: int, *, every_piece: bool = False) -> None:
        """Reduce pieces whose ``algorithm`` is ``"hierarchical"`` (every piece with ``every_piece``) by
        the two-level algorithm on Horovod process sets, ranks node-major (rank ``k`` is local rank
        ``k % r`` of node ``k // r``): a reduce-scatter among the node's ranks, an all-reduce of the
        shard among the ranks of the same local rank (one per node), an all-gather among the node's
        ranks. Every rank must call it with the same arguments at the same point: it registers those
        process sets (``hvd.add_process_set``, which needs Horovod started with dynamic process sets,
        ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``hvd.init(process_sets="dynamic")``; sets with the same
        ranks given to ``hvd.init(process_sets=[...])`` are used as they are). On one node or one
        rank per node pieces take the plain all-reduce."""
        if nodes < 1 or ranks_per_node < 1 or nodes * ranks_per_node != self.world_size:
            raise ValueError(f"a hierarchical all-reduce on {nodes} node(s) x {ranks_per_node} rank(s) needs "
                             f"{nodes * ranks_per_node} Horovod ranks, but there are {self.world_size}; plan for "
                             "this run's topology (ranks are node-major: rank k is on node k // ranks_per_node)")
        if self._two_level is not None:
            first = self._two_level
            if (nodes, ranks_per_node, bool(every_piece)) == (first.nodes, first.ranks_per_node, first.every_piece):
                return  # a later plan on the same engine: the same process sets serve it
            raise ValueError("use_hierarchical() was called twice on this backend with different arguments "
                             f"({nodes}x{ranks_per_node}, every_piece={every_piece}; first "
                             f"{first.nodes}x{first.ranks_per_node})")
        two = _HorovodTwoLevel(nodes, ranks_per_node, bool(every_piece))
        if nodes > 1 and ranks_per_node > 1:
            node, local = divmod(self.rank, ranks_per_node)
            # every rank registers every set, in this one order
            for n in range(nodes):
                ps = self._process_set([n * ranks_per_node + i for i in range(ranks_per_node)])
                if n == node:
                    two.node_set = ps
            for i in range(ranks_per_node):
                ps = self._process_set([n * ranks_per_node + i for n in range(nodes)])
                if i == local:
                    two.cross_set = ps
        self._two_level = two

    def _process_set(self, ranks: list[int]) -> Any:
        """The Horovod process set of exactly ``ranks``: one given to ``hvd.init``, else a new one."""
        hvd = self._hvd
        try:  # sets given to hvd.init(process_sets=[...]) or added before (Horovod's own table)
            from horovod.torch.mpi_ops import _basics
            known = _basics._get_process_set_ids_and_ranks()
        except Exception:  # noqa: BLE001 - a private table; without it, only adding is tried
            known = {}
        for set_id, members in known.items():
            if list(members) == ranks and set_id != 0:
                ps = hvd.ProcessSet(ranks)
                ps.process_set_id = set_id
                return ps
        try:
            return hvd.add_process_set(ranks)
        except ValueError as exc:
            raise CommschedError(
                f"the two-level algorithm on Horovod needs a process set of ranks {ranks}, and Horovod cannot add "
                f"one now ({exc}); start Horovod with dynamic process sets (HOROVOD_DYNAMIC_PROCESS_SETS=1 in "
                "horovodrun's environment, or hvd.init(process_sets='dynamic')), or pass every node's ranks and "
                "every local rank's ranks across nodes to hvd.init(process_sets=[...]); or use a plan without "
                "two-level pieces") from exc

    def start(self, piece: Any, done: Callable[[Optional[BaseException]], None]) -> None:
        if not self._hvd.is_initialized():
            raise CommschedError("Horovod was shut down while commsched still had pieces to reduce; call "
                                 "opt.synchronize() and opt.close() before hvd.shutdown()")
        name = f"commsched.{piece.name}"
        two = self._two_level
        if two is not None and two.node_set is not None and (
                two.every_piece or getattr(piece, "algorithm", "ring") == "hierarchical"):
            self._start_two_level(piece.view, done, name)
            return
        handle = self._hvd.allreduce_async_(piece.view, name=name, op=self._op, prescale_factor=self._prescale,
                                            postscale_factor=self._postscale)
        self._track(handle, done, name)

    def _track(self, handle: Any, done: Callable[[Optional[BaseException]], None], name: str,
               then: Optional[Callable[[Any], None]] = None) -> None:
        """Hand ``handle`` to the waiter thread: ``then(result)`` when it completes (the next phase of a
        two-level piece), else ``done(None)``; ``done(error)`` if it fails."""
        with self._cv:
            if self._closing:
                raise CommschedError("this Horovod backend is closed; create a new DistributedOptimizer")
            self._handles.append((handle, done, name, then))
            self._cv.notify()

    def _start_two_level(self, view: torch.Tensor, done: Callable[[Optional[BaseException]], None],
                         name: str) -> None:
        """Phase 1 of the two-level sum (see :meth:`use_hierarchical`); the waiter thread starts the
        next phases as each completes. A piece whose length is not a multiple of the ranks per node
        is padded with zeros, so every shard has the same length."""
        two, hvd = self._two_level, self._hvd
        two.pieces += 1
        flat = view.reshape(-1)
        n, r = flat.numel(), two.ranks_per_node
        padded = flat
        if n % r:
            padded = torch.zeros(r * -(-n // r), dtype=flat.dtype, device=flat.device)
            padded[:n].copy_(flat)
        # Sums all the way (Horovod's Average divides by each set's size); the average's scaling is
        # applied once, at the end, as allreduce_async_'s prescale/postscale would.
        pre = self._prescale
        post = self._postscale / self.world_size if self._op == hvd.Average else self._postscale

        def gathered(whole: torch.Tensor) -> None:
            if post != 1.0:
                whole.mul_(post)
            view.copy_(whole[:n].view_as(view))
            done(None)

        def reduced(shard: torch.Tensor) -> None:
            self._track(hvd.allgather_async(shard, name=name + ".ag", process_set=two.node_set), done, name,
                        then=gathered)

        def scattered(shard: torch.Tensor) -> None:
            self._track(hvd.allreduce_async_(shard, name=name + ".ar", op=hvd.Sum, process_set=two.cross_set),
                        done, name, then=reduced)

        self._track(hvd.reducescatter_async(padded, name=name + ".rs", op=hvd.Sum, process_set=two.node_set,
                                            prescale_factor=pre), done, name, then=scattered)

    def _wait_loop(self) -> None:
        delay = _POLL_MIN_S
        while True:
            with self._cv:
                while not self._handles and not self._closing:
                    self._cv.wait()
                if not self._handles:
                    return
                batch = list(self._handles)
            finished = []
            results = {}
            for entry in batch:
                try:
                    if not self._hvd.poll(entry[0]):
                        continue
                    results[id(entry)] = self._hvd.synchronize(entry[0])  # done: at once (or Horovod's error)
                except BaseException as exc:  # Horovod reports a dead peer or its shutdown here
                    with self._cv:
                        if self._broken is None:
                            self._broken = (time.monotonic(), exc)
                    finished.append((entry, exc))
                else:
                    finished.append((entry, None))
            lost = self._lost_handles(finished)
            for entry, error in finished + lost:
                done, then = entry[1], entry[3]
                if error is None and then is not None:
                    try:  # the next phase of a two-level piece
                        then(results.pop(id(entry)))
                    except BaseException as exc:  # noqa: BLE001 - the piece fails, the thread goes on
                        done(exc)
                    continue
                done(error)
            if finished or lost:
                delay = _POLL_MIN_S
                continue
            with self._cv:
                if len(self._handles) == len(batch):  # nothing new arrived: back off
                    self._cv.wait(delay)
                    delay = min(delay * 2, _POLL_MAX_S)
                else:
                    delay = _POLL_MIN_S

    def _lost_handles(self, finished: list) -> list:
        """Take ``finished`` out of the handles in flight, and with them those that will never
        complete (Horovod broke ``LOST_GRACE_S`` ago, or close's ``timeout_s`` passed), each
        paired with the error its ``done`` gets."""
        now = time.monotonic()
        with self._cv:
            gone = {id(entry) for entry, _ in finished}
            self._handles = [e for e in self._handles if id(e) not in gone]
            why = None
            if self._broken is not None and now >= self._broken[0] + min(self.LOST_GRACE_S, self.timeout_s):
                why = (f"Horovod stopped ({type(self._broken[1]).__name__}: {self._broken[1]}) and never completed "
                       "this piece; a peer rank has probably died", self._broken[1])
            elif self._closing and now >= self._close_deadline:
                why = (f"Horovod did not complete this piece within {self.timeout_s:g} s of close(); a peer rank may "
                       "have died mid-collective", None)
            if why is None or not self._handles:
                return []
            lost, self._handles = self._handles, []
        out = []
        for entry in lost:
            error = CommunicationError(f"{entry[2]}: {why[0]}", tensor=entry[2])
            error.__cause__ = why[1]
            out.append((entry, error))
        return out

    def _finish(self, handle: Any, what: str) -> Any:
        """The result of ``handle`` (an asynchronous Horovod operation the user's thread issued),
        waiting at most ``timeout_s``; ``CommschedTimeout`` naming ``what`` otherwise."""
        deadline = time.monotonic() + self.timeout_s
        delay = _POLL_MIN_S
        while not self._hvd.poll(handle):
            if time.monotonic() >= deadline:
                raise CommschedTimeout(f"Horovod {what} (is every rank alive and at the same call?)", self.timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        try:
            return self._hvd.synchronize(handle)
        except CommschedError:
            raise
        except Exception as exc:
            raise CommunicationError(f"Horovod {what} failed ({type(exc).__name__}: {exc}); a peer rank has "
                                     "probably died") from exc

    def _next_name(self, kind: str) -> str:
        self._collectives += 1
        return f"commsched.{kind}.{self._collectives}"

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrite ``tensor`` with rank ``root``'s, in place (``hvd.broadcast_async_``), within ``timeout_s``."""
        name = self._next_name("broadcast")
        self._finish(self._hvd.broadcast_async_(tensor, root, name=name), f"broadcast {name}")

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable), in rank order; each of its two all-gathers within ``timeout_s``."""
        name = self._next_name("all_gather_object")
        data = _pickled(obj)
        sizes = self._finish(self._hvd.allgather_async(torch.tensor([data.numel()], dtype=torch.int64),
                                                       name=name + ".sizes"), f"all-gather {name}")
        joined = self._finish(self._hvd.allgather_async(data, name=name + ".data"), f"all-gather {name}")
        return [_unpickled(part) for part in torch.split(joined, [int(n) for n in sizes.tolist()])]

    def all_gather_rows(self, ids: torch.Tensor, rows: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's ``ids`` and ``rows`` (any number of rows per rank), concatenated in rank order
        (``hvd.allgather``), each within ``timeout_s``: a split tied embedding's rows
        (:mod:`commsched.plugins.torch.tied`). It runs on the split's own thread beside the scheduler's
        pieces: Horovod matches operations by name, so ``name`` (the same on every rank, one exchange
        in flight per name) is all the ranks need to agree on."""
        got_ids = self._hvd.allgather_async(ids, name=name + ".ids")
        got_rows = self._hvd.allgather_async(rows, name=name + ".rows")
        return self._finish(got_ids, f"all-gather {name}.ids"), self._finish(got_rows, f"all-gather {name}.rows")

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Rank ``root``'s ``obj`` (picklable), on every rank; each of its two broadcasts within ``timeout_s``."""
        # Explicit names, the same on every rank: Horovod matches operations by name.
        name = self._next_name("broadcast_object")
        data = _pickled(obj) if self.rank == root else None
        size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
        self._finish(self._hvd.broadcast_async_(size, root, name=name + ".size"), f"broadcast {name}")
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._finish(self._hvd.broadcast_async_(data, root, name=name + ".data"), f"broadcast {name}")
        return _unpickled(data)

    def close(self) -> None:
        """Stop the waiter thread once every handle it holds completed, or failed after ``timeout_s``
        (a peer's death can leave one incomplete for ever). Idempotent."""
        with self._cv:
            if not self._closing:
                self._closing = True
                self._close_deadline = time.monotonic() + self.timeout_s
            self._cv.notify()
        self._thread.join(timeout=self.timeout_s + 1.0)
        if self._thread.is_alive():
            raise CommschedError(f"the Horovod waiter thread {self._thread.name} did not stop within "
                                 f"{self.timeout_s + 1.0:.0f} s of close()")


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def horovod_initialized() -> bool:
    """True when the user's script imported ``horovod.torch`` and called ``hvd.init()``.

    Looks only at modules already imported: ``backend="auto"`` never imports Horovod
    (seconds, and a C++ library) for a script that does not use it."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is None:
        return False
    try:
        return bool(hvd.is_initialized())
    except Exception:  # a half-imported or broken Horovod is not "initialized"
        return False


def resolve_backend(name: str) -> str:
    """The backend ``name`` stands for: ``"auto"`` is ``"horovod"`` when ``horovod.torch`` is
    initialized (a ``horovodrun`` script), else ``"torch"``; a name of :data:`BACKENDS` is
    itself. Raises ``ValueError`` for anything else (before any thread or group exists)."""
    if name not in CHOICES:
        raise ValueError(f"backend={name!r} is not a torch backend; use 'auto' (the default: Horovod when "
                         "horovod.torch is initialized, else torch.distributed), 'torch' (torch.distributed: "
                         "gloo or NCCL) or 'horovod'")
    if name == "auto":
        return "horovod" if horovod_initialized() else "torch"
    return name


def make_backend(name: str, group: Optional["dist.ProcessGroup"] = None,
                 timeout_s: float = 30.0) -> "TorchBackend | HorovodBackend":
    """The backend called ``name`` (one of :data:`CHOICES`, see :func:`resolve_backend`);
    ``timeout_s`` bounds the backend's close (Horovod's waiter, the CUDA completion thread)."""
    name = resolve_backend(name)
    if name == "torch":
        return TorchBackend(group, timeout_s=timeout_s)
    if name == "horovod":
        if group is not None:
            raise ValueError("process_group is a torch.distributed group; backend='horovod' reduces over all "
                             "Horovod ranks (leave process_group=None)")
        return HorovodBackend(timeout_s)
    raise ValueError(f"backend={name!r} is not a torch backend; use 'torch' (torch.distributed: gloo or NCCL) "
                     "or 'horovod'")
