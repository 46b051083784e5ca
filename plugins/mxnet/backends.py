"""The collective engine under the scheduler: MXNet KVStore push/pull, one sub-key per piece.

``KVStoreBackend.start(piece, done)`` issues ``pushpull`` of the piece's sub-key
on the wrapped ps-lite KVStore (``dist_sync``): the servers sum the pieces of
every worker (or apply the optimizer to them) and the result is pulled into the
piece's target view. An engine notifier on the target calls ``done(None)`` once
the pulled data is in place. The call returns at once: MXNet runs push and pull
in its engine.

Sub-keys start at :data:`FIRST_SUB_KEY`, clear of the Trainer's keys 0..N, and are
handed out by :func:`allocate_sub_keys`, per wrapped store. :func:`order_store`
connects the workers to the small TCP store that carries order agreement.

In ``dist_sync`` a server answers a push only after *every* worker pushed that
key, so a piece in flight on one worker waits for the others to start it too.
That is why the workers must start pieces in the same order (the scheduler's
order agreement), or a small credit deadlocks.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import weakref
from typing import Callable, Mapping, Optional

import mxnet as mx
import numpy as np

from commsched.scheduler import Piece
from commsched.tcpstore import StoreClient, StoreServer
from commsched.plugins.mxnet.gate import Gates
from commsched.plugins.mxnet.tensor_ops import Transfer
from commsched.plugins.mxnet.timing import StepTimes

__all__ = ["FIRST_SUB_KEY", "KVStoreBackend", "advertised_host", "allocate_sub_keys", "order_store", "server_count",
           "sync_kvstore"]

log = logging.getLogger(__name__)

FIRST_SUB_KEY = 1 << 24
"""The first KVStore key commsched uses; the Trainer's own keys are 0..N, far below."""
_LAST_SUB_KEY = (1 << 31) - 1  # keys travel as C int

# The next free sub-key of every wrapped ps-lite store, so that several commsched
# KVStores on the same store (a test comparing settings, say) never share a key.
_next_sub_key: "weakref.WeakKeyDictionary[mx.kv.KVStore, int]" = weakref.WeakKeyDictionary()
_next_sub_key_lock = threading.Lock()


class KVStoreBackend:
    """:class:`commsched.Backend` over an MXNet KVStore.

    ``start`` pushes the source view of the piece under sub-key
    ``transfer.first_key + piece.index`` and pulls into the target view;
    ``notify`` (engine notifier) reports completion. ``negotiates_order`` is False:
    ps-lite matches pushes by key, and a dist_sync server holds each push until all
    workers sent it, so the order must be agreed.
    """

    negotiates_order = False

    def __init__(self, kvstore: mx.kv.KVStore, gates: Optional[Gates]) -> None:
        self.kvstore = kvstore
        self.rank = int(kvstore.rank)
        self.world_size = int(kvstore.num_workers)
        self._gates = gates
        #: where started and landed pieces are counted (:class:`~commsched.plugins.mxnet.timing.StepTimes`), or None
        self.times: Optional[StepTimes] = None
        self._waiter: queue.SimpleQueue = queue.SimpleQueue()
        self._waiter_thread: Optional[threading.Thread] = None
        if gates is None:
            self._waiter_thread = threading.Thread(target=self._wait_loop, name=f"commsched-mx-wait-r{self.rank}",
                                                   daemon=False)
            self._waiter_thread.start()

    def start(self, piece: Piece, done: Callable[[Optional[BaseException]], None]) -> None:
        transfer: Transfer = piece.task.tensor
        source, target = transfer.pieces[piece.index]
        key = transfer.first_key + piece.index
        times, step = self.times, piece.task.step
        if times is not None:  # the piece's span, for the KVStore's report
            index = times.piece_started(step, piece.nbytes, time.monotonic())
            inner = done

            def done(exc: Optional[BaseException]) -> None:
                times.piece_done(step, index, time.monotonic())
                inner(exc)
        if target is source:
            self.kvstore.pushpull(key, source, priority=-piece.task.priority)
        else:
            self.kvstore.pushpull(key, source, out=target, priority=-piece.task.priority)
        if self._gates is not None:
            self._gates.notify(target, lambda: done(None))
        else:
            self._waiter.put((target, done))
        transfer.piece_started()

    def close(self) -> None:
        """Stop the waiter thread of the fallback path (if any). Idempotent."""
        thread, self._waiter_thread = self._waiter_thread, None
        if thread is not None:
            self._waiter.put(None)
            thread.join(timeout=30.0)

    def _wait_loop(self) -> None:
        # Fallback without the engine C API: learn completion by waiting, in issue order.
        while True:
            item = self._waiter.get()
            if item is None:
                return
            array, done = item
            try:
                array.wait_to_read()
            except BaseException as exc:  # an engine error on this array
                done(exc)
                continue
            done(None)


def sync_kvstore(kvstore: str | mx.kv.KVStore) -> mx.kv.KVStore:
    """The ps-lite store to drive: ``kvstore`` itself, or a new one of that type; asynchronous ones refused."""
    if isinstance(kvstore, str):
        if "async" in kvstore:
            raise ValueError(f"kvstore={kvstore!r}: commsched schedules synchronous training only; "
                             "use 'dist_sync' (asynchronous stores need no agreement on order)")
        kvstore = mx.kv.create(kvstore)
    elif not isinstance(kvstore, mx.kv.KVStore):
        raise TypeError(f"kvstore must be a KVStore type name such as 'dist_sync' or an mx.kv.KVStore, "
                        f"not {type(kvstore).__name__}")
    if "async" in kvstore.type:
        raise ValueError(f"the wrapped KVStore is {kvstore.type!r}; commsched schedules synchronous training only")
    return kvstore


def allocate_sub_keys(kvstore: mx.kv.KVStore, count: int) -> int:
    """Reserve ``count`` consecutive sub-keys of ``kvstore``; returns the first.

    Every worker must allocate in the same order (sub-keys are numbered in it).
    """
    with _next_sub_key_lock:
        first = _next_sub_key.get(kvstore, FIRST_SUB_KEY)
        if first + count - 1 > _LAST_SUB_KEY:
            raise ValueError(f"commsched ran out of KVStore sub-keys ({count} more needed); use a larger "
                             "partition_bytes so that tensors are cut into fewer pieces")
        _next_sub_key[kvstore] = first + count
    return first


def order_store(kvstore: mx.kv.KVStore) -> tuple[StoreServer | None, StoreClient]:
    """Connect every worker to the order-agreement store, which worker 0 serves.

    Worker 0's address reaches the others through one sub-key of ``kvstore``
    (``init`` keeps worker 0's value and is a barrier). Returns worker 0's server
    (None elsewhere) and this worker's client; the caller closes both.
    """
    server = None
    address = np.zeros(5, dtype=np.float32)
    if int(kvstore.rank) == 0:
        server = StoreServer(advertised_host(), 0)
        address[:] = [int(x) for x in server.host.split(".")] + [server.port]
    key = allocate_sub_keys(kvstore, 1)
    try:
        kvstore.init(key, mx.nd.array(address))
        got = mx.nd.zeros(5)
        kvstore.pull(key, out=got)
        values = got.asnumpy().astype(np.int64)
        return server, StoreClient(".".join(str(v) for v in values[:4]), int(values[4]))
    except BaseException:
        if server is not None:
            server.close()
        raise


def advertised_host(environ: Mapping[str, str] | None = None) -> str:
    """The IPv4 address the other workers can reach this one on, as ps-lite chooses it.

    This and :func:`server_count` are the only places the plugin reads ps-lite's variables: ``DMLC_NODE_HOST``
    if set (``commsched launch`` sets it), else the address of the interface that
    routes to ``DMLC_PS_ROOT_URI`` (no packet is sent), else 127.0.0.1.
    """
    env = os.environ if environ is None else environ
    host = env.get("DMLC_NODE_HOST")
    if host:
        return socket.gethostbyname(host)
    root = env.get("DMLC_PS_ROOT_URI")
    if root:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((socket.gethostbyname(root), int(env.get("DMLC_PS_ROOT_PORT", "9")) or 9))
                return str(probe.getsockname()[0])
        except OSError as exc:
            log.warning("could not find the interface towards DMLC_PS_ROOT_URI=%s (%s); using 127.0.0.1", root, exc)
    return "127.0.0.1"


def server_count(environ: Mapping[str, str] | None = None) -> int | None:
    """The number of ps-lite servers of this job (``DMLC_NUM_SERVER``), or None when it is not a
    positive integer (a ``local`` store has none)."""
    env = os.environ if environ is None else environ
    try:
        count = int(env.get("DMLC_NUM_SERVER", ""))
    except ValueError:
        return None
    return count if count > 0 else None
