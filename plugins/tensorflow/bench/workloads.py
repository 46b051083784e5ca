"""The TensorFlow benchmark's workload: an MLP on synthetic data with fixed seeds."""

from __future__ import annotations

from typing import Any

from commsched.bench.options import CLASSES, INPUTS, mlp_workload

__all__ = ["CLASSES", "INPUTS", "build_model", "describe"]

#: The report's ``workload`` block (no framework import).
describe = mlp_workload


def build_model(hidden: int, layers: int) -> Any:
    """The Keras 3 model, seeded (call inside the distribution strategy's scope)."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((INPUTS,))]
                            + [keras.layers.Dense(hidden, activation="relu") for _ in range(layers)]
                            + [keras.layers.Dense(CLASSES)])


def synthetic_data(rank: int, batch: int) -> Any:
    """An endless ``tf.data`` iterator over 4 batches of this rank's synthetic data."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(rank)
    xs = rng.standard_normal((4 * batch, INPUTS)).astype("float32")
    ys = rng.integers(0, CLASSES, 4 * batch).astype("int32")
    return iter(tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch).repeat())
