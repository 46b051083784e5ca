"""MXNet arrays as the KVStore API takes them and as the core cuts them.

:func:`single` / :func:`key_items` check the arguments of KVStore calls; a
:class:`KeyEntry` is one user key's layout (shape, sub-keys, piece ranges); a
:class:`Transfer` is what one ``pushpull`` moves, and :class:`TransferOps` is how
the core sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mxnet as mx
import numpy as np

__all__ = ["KeyEntry", "Transfer", "TransferOps", "as_list", "check_array", "flat", "key_items", "single"]


def flat(array: mx.nd.NDArray) -> mx.nd.NDArray:
    """``array`` as one dimension: a view on the same memory and engine variable."""
    return array.reshape((-1,))


def check_array(key: object, array: mx.nd.NDArray) -> None:
    """Raise ``ValueError`` naming ``key`` for arrays commsched cannot communicate."""
    if not isinstance(array, mx.nd.NDArray):
        raise ValueError(f"key {key!r}: expected an mxnet.nd.NDArray, got {type(array).__name__}")
    if array.stype != "default":
        raise ValueError(
            f"key {key!r} holds a {array.stype} array; commsched communicates dense arrays only. Keep sparse "
            "parameters on a plain mx.kv.create('dist_sync') KVStore (Embedding(sparse_grad=False) makes them dense)."
        )


def single(key: Any, values: Any, what: str) -> mx.nd.NDArray:
    """The one array of ``values`` (an array or a one-element list), checked; one context per process."""
    if isinstance(values, (list, tuple)):
        if len(values) != 1:
            raise ValueError(f"key {key!r}: {len(values)} {what} arrays given; commsched supports one context "
                             "per worker process (start one worker per device with commsched launch)")
        values = values[0]
    check_array(key, values)
    return values


def key_items(key: Any, value: Any, out: Any = None) -> list[tuple[Any, Any, Any]]:
    """``(key, value, out)`` for each key of a KVStore call that takes one key or a list of keys."""
    if isinstance(key, (list, tuple)):
        outs = out if out is not None else [None] * len(key)
        if len(value) != len(key) or len(outs) != len(key):
            raise ValueError(f"{len(key)} keys need as many values (got {len(value)}) and outputs")
        return list(zip(key, value, outs, strict=True))
    return [(key, value, out)]


def as_list(arrays: Any) -> list[Any]:
    """``arrays`` as a list (one array, or a list of arrays: one per context)."""
    return list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]


class KeyEntry:
    """One user key: its shape, its sub-keys and pieces, and the transfer of its latest ``pushpull``.

    ``bounds`` are the scheduler's piece ranges for the key's size
    (:meth:`commsched.Scheduler.bounds`); piece ``i`` is sub-key ``first_key + i``.
    """

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
        self.arrays: tuple[Any, Any] = (None, None)  # (value, out) the transfer was made for

    @property
    def sub_keys(self) -> list[int]:
        return [self.first_key + i for i in range(len(self.bounds))]

    def views(self, array: mx.nd.NDArray) -> list[mx.nd.NDArray]:
        """``array`` cut into this key's pieces (flat views on its memory and engine variable)."""
        return [flat(array)[a:b] for a, b in self.bounds]

    def check(self, array: mx.nd.NDArray, what: str) -> None:
        """Raise ``ValueError`` unless ``array`` has the key's shape and dtype."""
        if tuple(array.shape) != self.shape or np.dtype(array.dtype) != self.dtype:
            raise ValueError(f"key {self.key!r}: {what} has shape {tuple(array.shape)} and dtype {array.dtype}, "
                             f"but the key was initialized with shape {self.shape} and dtype {self.dtype}")

    def prepare(self, value: mx.nd.NDArray, target: mx.nd.NDArray | None,
                avatar: Callable[[mx.nd.NDArray], mx.nd.NDArray] | None) -> tuple[Transfer, mx.nd.NDArray]:
        """The transfer of a ``pushpull(value, out=target)``, and the array whose writes make it ready.

        Without ``out`` the sum replaces ``value``; with ``out`` the value is first
        copied into a push buffer, because ps-lite pulls into the push source and
        ``value`` (a gradient accumulated with grad_req='add') must stay intact.
        The transfer is made once per pair of arrays and reused: its pieces are
        ``avatar(view)`` of each piece's view, or the views themselves. Making an
        avatar waits for the array's queued operations, so this must run before
        anything blocks the array in the engine.
        """
        if target is None:
            staging = value
        else:
            if self.push_buffer is None:
                self.push_buffer = mx.nd.zeros(self.shape, ctx=value.context, dtype=self.dtype)
            staging = self.push_buffer
            value.copyto(staging)
        if self.transfer is None or self.arrays[0] is not value or self.arrays[1] is not target:
            make = avatar if avatar is not None else (lambda view: view)
            src = [make(v) for v in self.views(staging)]
            dst = src if target is None else [make(v) for v in self.views(target)]
            self.transfer = Transfer(name=str(self.key), size=self.size, dtype=self.dtype, first_key=self.first_key,
                                     pieces=list(zip(src, dst, strict=True)))
            self.arrays = (value, target)
        return self.transfer, staging


@dataclass(eq=False)
class Transfer:
    """What one ``pushpull`` of one key moves, cut into pieces.

    ``pieces[i]`` is ``(source, target)``: the flat views (or avatars) piece ``i`` is
    pushed from and pulled into, under the KVStore sub-key ``first_key + i``. They
    are cut at :meth:`commsched.Scheduler.bounds`, the ranges the scheduler cuts
    the transfer into, so piece ``i`` of the scheduler is piece ``i`` here. Source
    and target are the same array when the sum replaces the gradient. Made once
    per array and reused every step.
    """

    name: str
    size: int
    dtype: np.dtype
    first_key: int
    pieces: list[tuple[mx.nd.NDArray, mx.nd.NDArray]]
    on_issued: Optional[Callable[[], None]] = None
    _issued: int = 0

    def piece_started(self) -> None:
        """Count a started piece; call ``on_issued`` when the last one of this round started."""
        self._issued += 1
        if self._issued == len(self.pieces):
            self._issued = 0
            if self.on_issued is not None:
                self.on_issued()


class TransferOps:
    """:class:`commsched.partition.TensorOps` for :class:`Transfer`.

    A transfer's pieces exist before it is submitted (sub-keys and avatars are
    made at init), so a piece's view is just its element range; the backend finds
    the arrays as ``transfer.pieces[piece.index]``.
    """

    def numel(self, tensor: Transfer) -> int:
        return tensor.size

    def element_size(self, tensor: Transfer) -> int:
        return int(tensor.dtype.itemsize)

    def flat_view(self, tensor: Transfer, start: int, stop: int) -> tuple[int, int]:
        return (start, stop)
