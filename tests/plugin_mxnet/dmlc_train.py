"""A plain Gluon training script, started as dmlc's ``tools/launch.py --launcher local`` starts one.

The scheduler, the server and the workers all run this very file with ``DMLC_ROLE`` set by
hand (see test_dmlc_launch.py); for the scheduler and the server ``import mxnet`` runs the
role and exits. Against plain ``dist_sync`` the commsched run changes one import and the
kvstore string, and sets its settings through ``COMMSCHED_*`` only::

    python dmlc_train.py --kvstore dist_sync --out DIR
    python dmlc_train.py --kvstore dist_commsched --out DIR

Each worker writes ``DIR/rank<r>.npz`` (its final weights) and ``DIR/rank<r>.json`` (the
commsched store's counters and report, the commsched threads still alive after the
script's last line). The script never calls ``close()``: the process must exit by itself.
"""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--kvstore", required=True, choices=["dist_sync", "dist_commsched"])
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

if args.kvstore == "dist_commsched":
    import commsched.plugins.mxnet  # noqa: F401  (the one added line: registers the KVStore types)

import mxnet as mx  # noqa: E402  (server and scheduler: runs the role, then exits)
import numpy  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

BATCH, FEATURES = 8, 32

mx.random.seed(7)
net = gluon.nn.Sequential()
net.add(gluon.nn.Dense(48, in_units=FEATURES, activation="relu"),
        gluon.nn.Dense(40, in_units=48, activation="tanh"),
        gluon.nn.Dense(10, in_units=40))
net.initialize(mx.init.Xavier(magnitude=2.0))
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-4},
                        kvstore=args.kvstore)
if args.kvstore == "dist_sync":
    # mxnet 1.9.1's dist_sync broadcast does not wait for its pull, and the first gradient
    # push can overtake it (the pull then returns the gradient sum; about one run in four
    # here). The reference must be right, so it lets the initial pull land first.
    # (Private calls, in the order step() makes them; the reference only.)
    trainer._check_and_rescale_grad(trainer._scale / BATCH)
    trainer._init_kvstore()
    trainer._init_params()
    mx.nd.waitall()

# This worker's data shard (the test gives each worker its own; the store's rank is
# known only once the Trainer's first step created the store).
shard = int(os.environ["DATA_SHARD"])
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
for step in range(args.steps):
    rs = numpy.random.RandomState(1000 * step + shard)
    x, y = mx.nd.array(rs.rand(BATCH, FEATURES)), mx.nd.array(rs.randint(0, 10, BATCH))
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(BATCH)
mx.nd.waitall()

kv = trainer._kvstore
result = {"kvstore_type": None if kv is None else type(kv).__name__}
rank = kv.rank if kv is not None else -1
if args.kvstore == "dist_commsched" and kv is not None:
    import threading

    stats = kv.stats()
    result.update(pieces=stats["pieces"], max_in_flight_bytes=stats["max_in_flight_bytes"],
                  credit_bytes=stats["credit_bytes"], partition_bytes=stats["partition_bytes"],
                  report=kv.report(), numbers=kv.report_numbers())
    result["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("commsched"))
numpy.savez(os.path.join(args.out, f"rank{rank}.npz"), *[p.data().asnumpy() for p in net.collect_params().values()])
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
    json.dump(result, fh, default=str)
# no kv.close(): leaving without it must not hang
