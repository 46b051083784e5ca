"""The Horovod engine for the torch plugin (``backend="horovod"``).

Horovod matches operations across ranks by name through its rank-0 coordinator,
so ranks may issue pieces in different orders: only rank 0 paces by priority and
credit, the other ranks issue each piece as soon as it is ready
(``negotiates_order = True``). Pieces keep stable, unique names
(``commsched.<parameter>#<piece>``). Horovod's tensor fusion may merge pieces that
are ready in the same cycle (``HOROVOD_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``);
see docs/horovod.md for how that interacts with partition and credit.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Optional

import torch

from commsched.errors import CommschedError

__all__ = ["HorovodBackend"]


def _import_horovod():
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ValueError(
            "backend='horovod' needs Horovod built with PyTorch support; run `make horovod` in the commsched "
            f"repository (it builds and caches a patched Horovod 0.28.1 wheel). Import failed: {exc}") from exc
    return hvd


class HorovodBackend:
    """Pieces as ``hvd.allreduce_async_`` sums; a named waiter thread reports completions."""

    negotiates_order = True
    group = None

    def __init__(self) -> None:
        hvd = _import_horovod()
        if not hvd.is_initialized():
            hvd.init()
        self._hvd = hvd
        self.rank = hvd.rank()
        self.world_size = hvd.size()
        self._handles: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._broadcasts = 0
        self._thread = threading.Thread(target=self._wait_loop, name=f"commsched-horovod-r{self.rank}", daemon=False)
        self._thread.start()

    def start(self, piece: Any, done: Callable[[Optional[BaseException]], None]) -> None:
        if not self._hvd.is_initialized():
            raise CommschedError("Horovod was shut down while commsched still had pieces to reduce; call "
                                 "opt.synchronize() and opt.close() before hvd.shutdown()")
        handle = self._hvd.allreduce_async_(piece.view, name=f"commsched.{piece.name}", op=self._hvd.Sum)
        with self._cv:
            self._handles.append((handle, done))
            self._cv.notify()

    def _wait_loop(self) -> None:
        while True:
            with self._cv:
                while not self._handles and not self._closing:
                    self._cv.wait()
                if not self._handles:
                    return
                handle, done = self._handles.popleft()
            try:
                self._hvd.synchronize(handle)
            except BaseException as exc:  # Horovod reports a dead peer or shutdown here
                done(exc)
            else:
                done(None)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self._hvd.broadcast_(tensor, root, name=f"commsched.broadcast.{self._broadcasts}")
        self._broadcasts += 1

    def broadcast_object(self, obj: Any, root: int) -> Any:
        # An explicit name: Horovod's default is the object's type name, which differs
        # between the root (a dict) and the others (None) and deadlocks.
        return self._hvd.broadcast_object(obj, root, name="commsched.broadcast_object")

    def close(self) -> None:
        """Stop the waiter thread once every handle it holds has completed."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout=30)  # a handle of a dead peer may never return
