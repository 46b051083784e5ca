"""One MXNet benchmark process: ``python -m commsched.plugins.mxnet.bench.worker SPEC``.

Started by :class:`commsched.plugins.mxnet.launch.Job` (or alone, for
``compute``); trains the MLP of :mod:`.workloads` under one strategy (see
:mod:`.strategies`) and, on worker 0, writes ``rank0.json`` in the run
directory: the intervals between consecutive steps (``step_times_s``), ``world``
and ``pieces_per_step``. ps-lite scheduler and server processes run the same
command and return from ``import mxnet`` / KVStore creation as ps-lite decides.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from commsched.plugins.mxnet.bench.workloads import CLASSES, INPUTS, build_model


def _worker(spec_path: str) -> None:
    import numpy

    import mxnet as mx  # numpy.bool for mxnet 1.9.1 comes from the venv's shim (commsched_mxnet_numpy_compat.pth)
    from mxnet import autograd, gluon

    import commsched
    import commsched.plugins.mxnet as cmx

    spec = json.loads(Path(spec_path).read_text())
    strategy = spec["strategy"]
    kv = None
    trainer_args = {}
    if strategy in ("dist_sync", "dist_sync_server", "comm"):
        kv = mx.kv.create("dist_sync")
        trainer_args["update_on_kvstore"] = strategy == "dist_sync_server"
    elif strategy != "compute":
        server = strategy.endswith("_server")
        ordering = strategy.replace("_server", "")
        config = commsched.SchedulerConfig(partition_bytes=spec["partition_bytes"],
                                           credit_bytes=spec["credit_bytes"], ordering=ordering)
        kv = cmx.KVStore("dist_sync", config, update_on_kvstore=server)
        trainer_args["update_on_kvstore"] = server
    rank = kv.rank if kv is not None else 0

    net = build_model(spec["hidden"], spec["layers"])
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=kv,
                            **trainer_args)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rs = numpy.random.RandomState(rank)
    batch = spec["batch_size"]
    data = [(mx.nd.array(rs.randn(batch, INPUTS)), mx.nd.array(rs.randint(0, CLASSES, batch))) for _ in range(4)]
    ready = []
    total = spec["warmup"] + spec["steps"]
    if strategy == "comm":  # gradients once, then only their push/pull, step after step
        x, y = data[0]
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
    for step in range(total):
        if strategy == "comm":
            trainer.allreduce_grads()
            mx.nd.waitall()
            ready.append(time.perf_counter())
            continue
        x, y = data[step % len(data)]
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch)
        loss.wait_to_read()
        ready.append(time.perf_counter())
    mx.nd.waitall()
    intervals = [b - a for a, b in zip(ready[spec["warmup"]:-1], ready[spec["warmup"] + 1:], strict=True)]
    world = kv.num_workers if kv is not None else 1
    result = {"step_times_s": intervals, "world": world}
    if isinstance(kv, cmx.KVStore):
        stats = kv.stats()
        result["pieces_per_step"] = stats["pieces"] / total
        kv.close()
    if rank == 0:
        (Path(spec["out"]) / "rank0.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    """Run the worker of the spec file ``argv[0]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _worker(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
