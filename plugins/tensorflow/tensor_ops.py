"""Tensor operations of the TensorFlow plugin's reduction: densify, check, reassemble.

TensorFlow tensors are immutable values, so a piece is a slice of the flattened
gradient (inside a graph the runtime may alias or copy it; there is no in-place
reduction to preserve) and the reduced pieces are concatenated back.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

__all__ = ["check_gradient", "dense", "join_pieces"]

_SUPPORTED = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def dense(grad: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """The gradient as a dense tensor (embedding gradients arrive as ``IndexedSlices``)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def check_gradient(name: str, grad: tf.Tensor) -> None:
    """Raise ``ValueError`` naming the variable for gradients commsched cannot reduce."""
    if grad.dtype not in _SUPPORTED:
        raise ValueError(f"variable {name!r} has a {grad.dtype.name} gradient; commsched reduces float16, bfloat16, "
                         "float32 and float64 gradients")
    if not grad.shape.is_fully_defined():
        raise ValueError(f"variable {name!r} has a gradient of unknown shape {grad.shape}; commsched needs static "
                         "shapes to cut gradients into the same pieces on every worker (build the model with a "
                         "fixed input shape before the first step)")


def join_pieces(pieces: Sequence[tf.Tensor], like: tf.Tensor) -> tf.Tensor:
    """Concatenate reduced pieces (in element order) back into the shape of ``like``."""
    flat = pieces[0] if len(pieces) == 1 else tf.concat(list(pieces), axis=0)
    return tf.reshape(flat, like.shape)
