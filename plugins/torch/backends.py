"""Collective engines for the torch plugin.

``TorchBackend`` runs each piece as an asynchronous ``torch.distributed.all_reduce``
on the user's process group (gloo on CPU, NCCL on GPU). ``C10dStore`` adapts the
process group's rendezvous store to :class:`commsched.store.Store` for order agreement.
"""

from __future__ import annotations

import datetime
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from commsched.errors import CommschedError

__all__ = ["C10dStore", "TorchBackend", "default_store", "make_backend"]


class C10dStore:
    """:class:`commsched.store.Store` over a ``torch.distributed.Store`` (c10d's calls release the GIL)."""

    def __init__(self, store: "dist.Store") -> None:
        self._store = store
        self._popper: Optional["dist.Store"] = None
        self._popper_timeout: Optional[float] = None

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # c10d raises DistStoreError/RuntimeError; only a timeout is a TimeoutError
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise TimeoutError(str(exc)) from None
            raise
        return bytes(self._store.get(key))

    def check(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def delete(self, key: str) -> None:
        self._store.delete_key(key)

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


class TorchBackend:
    """Pieces as asynchronous sum all-reduces on a torch.distributed process group.

    On CUDA tensors the all-reduce is issued on a dedicated stream that first waits
    for the event recorded when the gradient was ready (``ready_event`` on the
    task), so communication never waits for unrelated compute.
    """

    negotiates_order = False

    def __init__(self, group: Optional["dist.ProcessGroup"] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "backend='torch' needs an initialized default process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') before creating DistributedOptimizer"
            )
        if group is None:
            # A group of our own: collectives the user issues on the default group
            # while pieces are still in flight (cross-iteration) cannot interleave
            # with ours in a different order on different ranks.
            group = dist.new_group(backend=dist.get_backend())
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            return stream

    def start(self, piece, done: Callable[[Optional[BaseException]], None]) -> None:
        if not dist.is_initialized():
            raise CommschedError(
                "the torch.distributed process group was destroyed while commsched still had pieces to "
                "reduce; call opt.synchronize() and opt.close() before destroy_process_group()"
            )
        view = piece.view
        if view.is_cuda:
            stream = self._stream(view.device)
            event = getattr(piece.task.tensor, "_commsched_ready_event", None)
            if event is not None:
                stream.wait_event(event)
            with torch.cuda.stream(stream):
                work = dist.all_reduce(view, group=self.group, async_op=True)
            piece.task.__dict__.setdefault("works", []).append(work)  # waited on before the update
        else:
            work = dist.all_reduce(view, group=self.group, async_op=True)

        def finished(fut: "torch.futures.Future") -> None:
            try:
                fut.value()
            except BaseException as exc:
                done(exc)
                return
            done(None)

        work.get_future().add_done_callback(finished)


    def close(self) -> None:
        """Drop our reference to the process group, so it is destroyed with the
        user's ``destroy_process_group()`` and not during interpreter teardown
        (where gloo's threads can abort the process)."""
        self.group = None
        self._streams.clear()


def make_backend(name: str, group: Optional["dist.ProcessGroup"] = None):
    """The backend called ``name`` ("torch" or "horovod")."""
    if name == "torch":
        return TorchBackend(group)
    if name == "horovod":
        from commsched.plugins.torch.horovod import HorovodBackend

        return HorovodBackend()
    raise ValueError(f"backend={name!r} is not known; use 'torch' (torch.distributed: gloo or NCCL) or 'horovod'")
