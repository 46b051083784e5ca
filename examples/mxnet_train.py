"""Train a Gluon MLP on synthetic data with the commsched KVStore (or plain dist_sync).

    commsched launch mxnet --workers 2 --servers 1 -- python examples/mxnet_train.py
    COMMSCHED_PARTITION_BYTES=1MiB COMMSCHED_CREDIT_BYTES=4MiB \\
        commsched launch mxnet --workers 2 --servers 1 -- python examples/mxnet_train.py --steps 50
    commsched launch mxnet --workers 2 --servers 1 -- python examples/mxnet_train.py --kvstore dist_sync

The only commsched line is ``import commsched.plugins.mxnet`` (it registers the
KVStore type); the Trainer is created as usual with ``kvstore=mx.kv.create("commsched")``.
Worker 0 prints the loss and the median step time.
"""

import argparse
import statistics
import time

import mxnet as mx
import numpy
from mxnet import autograd, gluon

import commsched.plugins.mxnet  # noqa: F401  (registers the 'commsched' KVStore type)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvstore", default="commsched", help="commsched (default) or dist_sync")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=512, help="width of the hidden layers")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    kv = mx.kv.create(args.kvstore)
    mx.random.seed(0)
    net = gluon.nn.Sequential()
    for _ in range(args.layers):
        net.add(gluon.nn.Dense(args.hidden, activation="relu"))
    net.add(gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 256)))  # resolve the deferred shapes before the Trainer sees them
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    # A learnable task: the label is the argmax of a fixed projection of the input.
    rs = numpy.random.RandomState(100 + kv.rank)
    projection = numpy.random.RandomState(0).randn(256, 10)
    times, losses = [], []
    for step in range(args.steps):
        x = rs.randn(args.batch_size, 256)
        data, label = mx.nd.array(x), mx.nd.array((x @ projection).argmax(axis=1))
        start = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(args.batch_size)
        losses.append(float(loss.mean().asscalar()))  # waits for this step's forward only
        times.append(time.perf_counter() - start)
        if kv.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    mx.nd.waitall()
    if kv.rank == 0:
        steady = times[len(times) // 3:] or times
        print(f"{args.kvstore}: {kv.num_workers} workers, median step {statistics.median(steady) * 1000:.1f} ms, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if hasattr(kv, "close"):
        kv.close()


if __name__ == "__main__":
    main()
