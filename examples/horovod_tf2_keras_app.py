"""Horovod's TF2 custom-loop shape (``tensorflow2_synthetic_benchmark.py``) on a
``keras.applications`` model, with commsched's tape as the one changed line.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_tf2_keras_app.py --steps 3

Was: ``tape = hvd.DistributedGradientTape(tape, compression=compression)`` — which
fails on Keras 3 variables in Horovod 0.28.1. ``--check`` also computes each step's
gradients with ``hvd.allreduce(op=hvd.Average)`` from the same tape and records the
largest difference; ``--json`` writes rank 0's figures.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import commsched.plugins.tensorflow  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=10, alpha=0.35)
    opt = keras.optimizers.SGD(0.01 * hvd.size())
    compression = hvd.Compression.none
    rng = np.random.default_rng(hvd.rank())
    data = tf.constant(rng.standard_normal((args.batch_size, 32, 32, 3)), tf.float32)
    target = tf.constant(rng.integers(0, 10, args.batch_size))
    diffs, backends = [], []

    @tf.function
    def benchmark_step(first_batch):
        with tf.GradientTape(persistent=args.check) as tape:
            probs = model(data, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(target, probs))
        reference = tape.gradient(loss, model.trainable_variables) if args.check else None
        # Horovod: Add Horovod Distributed GradientTape.
        tape = commsched.plugins.tensorflow.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        backends.append(tape.commsched.backend.name)  # at trace time: "horovod" under horovodrun
        opt.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        if reference is None:
            return tf.constant(0.0)
        ref = [hvd.allreduce(g, op=hvd.Average, name=f"ref{i}") for i, g in enumerate(reference)]
        return tf.reduce_max([tf.reduce_max(tf.abs(a - b)) for a, b in zip(ref, gradients, strict=True)])

    for step in range(args.steps):
        diffs.append(float(benchmark_step(step == 0)))
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    gathered = hvd.allgather(flat[None], name="final")
    ranks_equal = bool(tf.reduce_all(gathered[0] == gathered[-1]))
    if hvd.rank() == 0:
        print(f"keras.applications.MobileNetV2 on {hvd.size()} ranks: {args.steps} steps, ranks equal {ranks_equal}, "
              f"max |commsched - hvd.allreduce| {max(diffs):.3g}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks_equal": ranks_equal, "max_diff": max(diffs), "steps": args.steps,
                           "variables": len(model.trainable_variables),
                           "backend": backends[0]}, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
