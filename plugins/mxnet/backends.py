"""The collective engine under the scheduler: MXNet KVStore push/pull, one sub-key per piece.

``KVStoreBackend.start(piece, done)`` issues ``pushpull`` of the piece's sub-key
on the wrapped ps-lite KVStore (``dist_sync``): the servers sum the pieces of
every worker (or apply the optimizer to them) and the result is pulled into the
piece's target view. An engine notifier on the target calls ``done(None)`` once
the pulled data is in place. The call returns at once: MXNet runs push and pull
in its engine.

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
from typing import Callable, Mapping, Optional

import mxnet as mx

from commsched.scheduler import Piece
from commsched.plugins.mxnet.gate import Gates
from commsched.plugins.mxnet.tensor_ops import Transfer

__all__ = ["KVStoreBackend", "advertised_host"]

log = logging.getLogger(__name__)


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
        self._waiter: queue.SimpleQueue = queue.SimpleQueue()
        self._waiter_thread: Optional[threading.Thread] = None
        if gates is None:
            self._waiter_thread = threading.Thread(target=self._wait_loop, name=f"commsched-mx-wait-r{self.rank}",
                                                   daemon=False)
            self._waiter_thread.start()

    def start(self, piece: Piece, done: Callable[[Optional[BaseException]], None]) -> None:
        transfer: Transfer = piece.task.tensor
        source, target = piece.view
        key = transfer.first_key + piece.index
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
        """Stop the waiter thread of the fallback path (if any)."""
        if self._waiter_thread is not None:
            self._waiter.put(None)
            self._waiter_thread.join(timeout=30.0)

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


def advertised_host(environ: Mapping[str, str] | None = None) -> str:
    """The IPv4 address the other workers can reach this one on, as ps-lite chooses it.

    This is the one place the plugin reads ps-lite's variables: ``DMLC_NODE_HOST``
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
