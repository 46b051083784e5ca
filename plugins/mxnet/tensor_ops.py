"""Zero-copy views the core needs, for MXNet NDArrays and KVStore transfers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import mxnet as mx
import numpy as np

__all__ = ["NDArrayOps", "Transfer", "TransferOps", "check_array", "flat"]


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


class NDArrayOps:
    """:class:`commsched.partition.TensorOps` for NDArrays: pieces are ``array.reshape(-1)[start:stop]``,
    views sharing the memory and the engine variable."""

    def numel(self, tensor: mx.nd.NDArray) -> int:
        return int(tensor.size)

    def element_size(self, tensor: mx.nd.NDArray) -> int:
        return int(np.dtype(tensor.dtype).itemsize)

    def flat_view(self, tensor: mx.nd.NDArray, start: int, stop: int) -> mx.nd.NDArray:
        return flat(tensor)[start:stop]


@dataclass(eq=False)
class Transfer:
    """What one ``pushpull`` of one key moves, cut into pieces.

    ``pieces[i]`` is ``(source, target)``: the flat views (or avatars) piece ``i``
    is pushed from and pulled into, under the KVStore sub-key ``first_key + i``;
    ``bounds[i]`` is its element range. Source and target are the same array when
    the sum replaces the gradient. Made once per array and reused every step.
    """

    name: str
    size: int
    dtype: np.dtype
    first_key: int
    bounds: list[tuple[int, int]]
    pieces: list[tuple[mx.nd.NDArray, mx.nd.NDArray]]
    on_issued: Optional[Callable[[], None]] = None
    _index: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)
    _issued: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self._index = {bound: i for i, bound in enumerate(self.bounds)}

    def view(self, start: int, stop: int) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
        """The ``(source, target)`` pair of the piece ``[start, stop)``."""
        try:
            return self.pieces[self._index[(start, stop)]]
        except KeyError:
            raise ValueError(f"key {self.name!r}: the scheduler cut a piece [{start}, {stop}) that the KVStore did "
                             "not initialize; partition_bytes must not change after init") from None

    def piece_started(self) -> None:
        """Count a started piece; call ``on_issued`` when the last one of this round started."""
        self._issued += 1
        if self._issued == len(self.pieces):
            self._issued = 0
            if self.on_issued is not None:
                self.on_issued()


class TransferOps:
    """:class:`commsched.partition.TensorOps` for :class:`Transfer`: a piece's view is the
    pair ``(source piece, target piece)``."""

    def numel(self, tensor: Transfer) -> int:
        return tensor.size

    def element_size(self, tensor: Transfer) -> int:
        return int(tensor.dtype.itemsize)

    def flat_view(self, tensor: Transfer, start: int, stop: int) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
        return tensor.view(start, stop)
