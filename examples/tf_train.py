"""Train an MLP on two local TensorFlow workers with commsched.

Start two workers on this machine (127.0.0.1, free ports) and wait for them:

    python examples/tf_train.py --launch 2                        # Keras 3 custom loop
    python examples/tf_train.py --launch 2 --unroll 2             # 2 steps per tf.function (overlap)
    python examples/tf_train.py --launch 2 --baseline             # stock MultiWorkerMirroredStrategy
    TF_USE_LEGACY_KERAS=1 python examples/tf_train.py --launch 2 --fit   # tf-keras model.fit

or start each worker yourself with its TF_CONFIG (one per machine or per terminal):

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]},
               "task": {"type": "worker", "index": 0}}' python examples/tf_train.py
    (and "index": 1 in the second terminal)

Each worker prints one JSON line: its rank, the mode, the mean step time and the
final loss. Keras 3 ``model.fit`` under MultiWorkerMirroredStrategy is broken
upstream (keras-team/keras#20585): with Keras 3 this script uses a custom loop.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launch", type=int, default=0, metavar="N", help="start N local workers and wait for them")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64, help="per-worker batch size")
    p.add_argument("--width", type=int, default=1024, help="hidden layer width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--partition-bytes", default="1MiB")
    p.add_argument("--credit-bytes", default="4MiB")
    p.add_argument("--unroll", type=int, default=1, help="steps per tf.function (custom loop only)")
    p.add_argument("--fit", action="store_true", help="model.fit (tf-keras: run with TF_USE_LEGACY_KERAS=1)")
    p.add_argument("--baseline", action="store_true", help="stock MWMS all-reduce instead of commsched")
    p.add_argument("--timeline", default=None, help="write commsched's planned timeline (Chrome trace) here")
    p.add_argument("--timeout", type=float, default=300.0, help="--launch: give up after this many seconds")
    return p.parse_args(argv)


def launch(args, argv) -> int:
    """Start ``args.launch`` copies of this script as TF_CONFIG workers on 127.0.0.1."""
    socks = [socket.socket() for _ in range(args.launch)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    rest, skip = [], False
    for a in argv:  # the workers get the same arguments, without --launch
        if skip or a.startswith("--launch="):
            skip = False
        elif a == "--launch":
            skip = True
        else:
            rest.append(a)
    procs = []
    for rank in range(args.launch):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}}))
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *rest], env=env))
    deadline = time.monotonic() + args.timeout
    status = 0
    for proc in procs:
        try:
            status = status or proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            status = 124
    for proc in procs:  # only the workers started here
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return status


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.launch:
        return launch(args, argv)

    import numpy as np
    import tensorflow as tf

    import commsched
    from commsched.plugins.tensorflow import DistributedOptimizer, unroll

    keras = tf.keras  # Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1
    legacy = keras.__name__.startswith("tf_keras")
    keras_version = __import__("tf_keras" if legacy else "keras").__version__
    if args.fit and not legacy:
        raise SystemExit("model.fit under MultiWorkerMirroredStrategy needs tf-keras (keras-team/keras#20585): "
                         "run with TF_USE_LEGACY_KERAS=1, or drop --fit to use the custom loop")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    world = strategy.num_replicas_in_sync
    config = commsched.SchedulerConfig(partition_bytes=args.partition_bytes, credit_bytes=args.credit_bytes,
                                       timeline=args.timeline)
    global_batch = args.batch * world

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((args.width,))]
                                 + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
                                 + [keras.layers.Dense(10)])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        if not args.baseline:
            opt = DistributedOptimizer(opt, config=config)

    rng = np.random.default_rng(rank)
    x = rng.standard_normal((args.batch * args.steps, args.width)).astype("float32")
    y = rng.integers(0, 10, args.batch * args.steps).astype("int32")

    if args.fit:
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat().with_options(options)
        start = time.perf_counter()
        history = model.fit(ds, epochs=1, steps_per_epoch=args.steps, verbose=0)
        elapsed = time.perf_counter() - start
        loss = float(history.history["loss"][-1])
    else:
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def train_step(xb, yb):
            with tf.GradientTape() as tape:
                per_example = loss_fn(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        def one_step(iterator):
            xb, yb = next(iterator)
            return strategy.run(train_step, args=(xb, yb))

        run = unroll(one_step, args.unroll)
        iterator = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat())
        run(iterator)  # trace and warm up (not timed)
        calls = max(1, (args.steps - args.unroll) // args.unroll)
        start = time.perf_counter()
        for _ in range(calls):
            losses = run(iterator)
        elapsed = time.perf_counter() - start
        loss = float(losses[-1]) * world  # this worker's mean loss (it was divided by the global batch)
        args.steps = calls * args.unroll
    line = json.dumps({"rank": rank, "workers": world, "mode": "mwms" if args.baseline else "commsched",
                       "fit": args.fit, "unroll": args.unroll, "keras": keras_version,
                       "step_ms": round(1000 * elapsed / max(1, args.steps), 2), "loss": round(loss, 4),
                       "iterations": int(opt.iterations.numpy())})
    # One write of the whole line: the workers share stdout, and unbuffered print() writes the
    # text and its newline separately, so two workers' lines could run into one.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    os._exit(0)  # do not wait for the other workers at exit


if __name__ == "__main__":
    sys.exit(main())
