"""One Horovod rank of the backend="horovod" test (started by horovodrun, see test_horovod.py).

Usage: horovodrun -np 2 -H localhost:2 --gloo python hvd_worker.py OUT_DIR

Trains the same Keras 3 model twice: summing gradients with plain
``hvd.allreduce`` then applying them with a stock optimizer (the reference), and
with ``DistributedOptimizer(..., backend="horovod")``; then a
``DistributedGradientTape(..., backend="horovod")`` step against ``hvd.allreduce``
averages. Writes OUT_DIR/hvd.<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import commsched
from commsched.plugins.tensorflow import DistributedGradientTape, DistributedOptimizer

hvd.init()
RANK, OUT = hvd.rank(), sys.argv[1]
CONFIG = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, timeout_s=60)
result: dict = {"rank": RANK, "size": hvd.size()}


def data(step):
    rng = np.random.default_rng(1000 * step + RANK)
    return rng.standard_normal((8, 20)).astype("float32"), rng.integers(0, 10, 8).astype("int32")


def train(wrap):
    import keras

    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(48, activation="relu"), keras.layers.Dense(10)])
    opt = keras.optimizers.Adam(1e-2)
    if wrap:
        opt = DistributedOptimizer(opt, config=CONFIG, backend="horovod")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) / hvd.size()
        grads = tape.gradient(loss, model.trainable_variables)
        if not wrap:
            grads = [hvd.allreduce(g, op=hvd.Sum, name=f"ref{i}") for i, g in enumerate(grads)]
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    for s in range(4):
        step(*data(s))
    return model, opt, step


def main():
    ref, _, _ = train(False)
    ours, opt, step = train(True)
    result["bitwise"] = all(np.array_equal(a, b) for a, b in zip(ref.get_weights(), ours.get_weights(), strict=True))
    result["max_abs_diff"] = float(max(np.max(np.abs(a - b)) for a, b in
                                       zip(ref.get_weights(), ours.get_weights(), strict=True)))
    result["iterations"] = int(opt.iterations.numpy())
    result["pieces"] = len(opt.commsched.plans[-1].pieces)
    result["off_chain"] = sum(p.slot < 0 for p in opt.commsched.plans[-1].pieces)
    result["fusion_bytes"] = opt.commsched.settings()["fusion_bytes"]
    graph = step.get_concrete_function(*data(0)).graph
    hvd_ops = [op for op in graph.get_operations() if op.type == "HorovodAllreduce"]
    result["hvd_ops"] = len(hvd_ops)
    result["hvd_stateful"] = bool(hvd_ops and hvd_ops[0]._is_stateful)

    v = tf.Variable(np.arange(6, dtype="float32") * (RANK + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    grads = DistributedGradientTape(tape, config=CONFIG, backend="horovod").gradient(loss, [v])
    expected = hvd.allreduce(2 * v, op=hvd.Average, name="tape_ref")
    result["tape_allclose"] = bool(np.allclose(grads[0].numpy(), expected.numpy(), rtol=1e-6, atol=0))


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        result["crash"] = traceback.format_exc()
    with open(os.path.join(OUT, f"hvd.{RANK}.json"), "w") as fh:
        json.dump(result, fh)
    hvd.shutdown()
