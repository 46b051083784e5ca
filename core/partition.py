"""Cutting tensors into pieces.

The core never touches tensor memory: a plugin supplies :class:`TensorOps`, and
the core asks it for flat, contiguous, zero-copy views of element ranges.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["TensorOps", "piece_bounds"]


class TensorOps(Protocol):
    """What the core needs to know about a framework's tensors.

    ``flat_view(t, start, stop)`` must return a view (no copy) of elements
    ``[start, stop)`` of the flattened, contiguous tensor ``t``; reducing the view
    in place must reduce that part of ``t``.
    """

    def numel(self, tensor: Any) -> int: ...

    def element_size(self, tensor: Any) -> int: ...

    def flat_view(self, tensor: Any, start: int, stop: int) -> Any: ...


def piece_bounds(numel: int, element_size: int, partition_bytes: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``[start, stop)`` ranges of at most ``partition_bytes``.

    Sizes are rounded down to whole elements, but every piece holds at least one
    element (so an element larger than ``partition_bytes`` still goes, alone). The
    ranges are contiguous, ordered, disjoint and cover ``[0, numel)`` exactly; a
    zero-size tensor has no pieces.
    """
    if numel < 0 or element_size <= 0 or partition_bytes <= 0:
        raise ValueError(
            f"piece_bounds needs numel >= 0, element_size > 0 and partition_bytes > 0, "
            f"got numel={numel}, element_size={element_size}, partition_bytes={partition_bytes}"
        )
    per_piece = max(1, partition_bytes // element_size)
    return [(start, min(start + per_piece, numel)) for start in range(0, numel, per_piece)]
