"""One worker of a dist_sync job started by ``commsched launch mxnet`` (see conftest.run_job).

Modes:
  scenarios  train each --scenario twice: with plain dist_sync (the reference) and
             with the commsched KVStore; record whether the weights are bitwise equal.
  order      pushpull keys in a rank-dependent order at a credit of one piece, with
             'dynamic' then 'fifo'; record whether each finished with the right sums.
  die        rank 1 exits hard after a few steps; rank 0 records the error it got.

Each rank writes ``<out>/rank<r>.json``. All scenarios share one ps-lite store, so
each reference uses its own key range (through OffsetKVStore, which issues exactly
the plain dist_sync calls the Trainer would, whole arrays, under shifted keys).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import mxnet as mx
import numpy
from helpers import commsched_threads  # tests/ is on PYTHONPATH (conftest.run_job)
from mxnet import autograd, gluon

import commsched
import commsched.plan
import commsched.plugins.mxnet as cmx

BATCH = 8
FEATURES = 32


class OffsetKVStore(mx.kv.KVStoreBase):
    """Plain dist_sync under keys shifted by ``offset`` (the reference; no commsched)."""

    def __init__(self, inner: mx.kv.KVStore, offset: int, optimizer: bool) -> None:
        self.inner, self.offset, self.optimizer = inner, offset, optimizer

    type = property(lambda self: self.inner.type)
    rank = property(lambda self: self.inner.rank)
    num_workers = property(lambda self: self.inner.num_workers)

    def is_capable(self, capability):
        return self.optimizer

    def broadcast(self, key, value, out, priority=0):
        self.inner.broadcast(key + self.offset, value, out, priority=priority)
        # mxnet 1.9.1 race: without this wait the first gradient push of a key can
        # reach the server before this worker's pull of the initial value, which
        # then returns the gradient sum (about one run in four here). The reference
        # must be right, so it waits; commsched's broadcast waits too.
        for o in out if isinstance(out, (list, tuple)) else [out]:
            o.wait_to_read()

    def pushpull(self, key, value, out=None, priority=0):
        self.inner.pushpull(key + self.offset, value, out=out, priority=priority)

    def set_optimizer(self, optimizer):
        self.inner.set_optimizer(optimizer)

    def _barrier(self):
        self.inner._barrier()


def make_net(seed: int) -> gluon.nn.Sequential:
    mx.random.seed(seed)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(48, in_units=FEATURES, activation="relu"),
            gluon.nn.Dense(40, in_units=48, activation="tanh"),
            gluon.nn.Dense(10, in_units=40))
    net.initialize(mx.init.Xavier(magnitude=2.0))
    return net


def optimizer(name: str):
    if name == "sgd_momentum":
        return "sgd", {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-4}
    if name == "adam":
        return "adam", {"learning_rate": 0.01}
    raise ValueError(name)


def batches(rank: int, steps: int, accumulate: int):
    rs = numpy.random.RandomState(1000 + rank)
    return [[(mx.nd.array(rs.rand(BATCH, FEATURES)), mx.nd.array(rs.randint(0, 10, BATCH)))
             for _ in range(accumulate)] for _ in range(steps)]


def train(net, trainer, data, sc, kv=None, log=None):
    """Train on ``data``; for commsched, note whether each forward was queued while results were pending."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    params = net.collect_params()
    for step, micro in enumerate(data):
        if kv is not None and log is not None and step > 0:
            log.append(kv.outstanding())  # > 0: this forward is queued before the last step's pulls landed
        for x, y in micro:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
        trainer.step(BATCH * len(micro))
        if sc.get("grad_req") == "add":
            params.zero_grad()
    mx.nd.waitall()


def weights(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]


def run_scenario(inner, index: int, sc: dict) -> dict:
    steps = sc.get("steps", 5)
    accumulate = 2 if sc.get("grad_req") == "add" else 1
    server = bool(sc.get("update_on_kvstore"))
    data = batches(inner.rank, steps, accumulate)
    name, opts = optimizer(sc.get("optimizer", "sgd_momentum"))

    ref_net = make_net(7)
    if sc.get("grad_req"):
        ref_net.collect_params().setattr("grad_req", sc["grad_req"])
    ref_kv = OffsetKVStore(inner, 1000 * (index + 1), optimizer=server)
    ref_trainer = gluon.Trainer(ref_net.collect_params(), name, dict(opts), kvstore=ref_kv, update_on_kvstore=server)
    train(ref_net, ref_trainer, data, sc)

    net = make_net(7)
    plan = make_plan(net, sc["plan"], inner.rank) if sc.get("plan") else None
    config = commsched.SchedulerConfig(partition_bytes=sc.get("partition", 1024), credit_bytes=sc.get("credit", 2048),
                                       ordering=sc.get("ordering", "dynamic"), timeout_s=60, plan=plan)
    if sc.get("refused"):  # a planned run that every worker must refuse: record what each one said
        return refused(inner, net, config, sc, data, name, opts)
    kv = cmx.KVStore(inner, config, update_on_kvstore=server, gate=sc.get("gate", "auto"))
    if sc.get("delay"):
        start, delay = kv._backend.start, sc["delay"]

        def delayed(piece, done):  # the scheduler is late on purpose: every piece waits
            time.sleep(delay)
            start(piece, done)
        kv._backend.start = delayed
    if sc.get("grad_req"):
        net.collect_params().setattr("grad_req", sc["grad_req"])
    trainer = gluon.Trainer(net.collect_params(), name, dict(opts), kvstore=kv, update_on_kvstore=server)
    queued_while_pending: list[int] = []
    result = {"scenario": sc, "rank": inner.rank, "gate_mode": kv.gate_mode}
    if sc.get("save_load"):
        # Train half, save the optimizer states, continue with a fresh Trainer (and a
        # fresh commsched KVStore) that loads them: must equal uninterrupted training.
        half = steps // 2
        train(net, trainer, data[:half], sc, kv, queued_while_pending)
        path = os.path.join(tempfile.mkdtemp(), f"states{inner.rank}")
        trainer.save_states(path)
        kv.close()
        kv = cmx.KVStore(inner, config)
        trainer = gluon.Trainer(net.collect_params(), name, dict(opts), kvstore=kv)
        trainer.load_states(path)
        train(net, trainer, data[half:], sc, kv, queued_while_pending)
    else:
        train(net, trainer, data, sc, kv, queued_while_pending)
        if server:
            try:
                trainer.save_states(os.path.join(tempfile.mkdtemp(), "states"))
                result["save_states_error"] = None
            except ValueError as exc:
                result["save_states_error"] = str(exc)
    kv.synchronize()
    stats = kv.stats()
    kv.close()
    got, ref = weights(net), weights(ref_net)
    if kv.plan is not None:
        result["plan_order"] = list(kv.plan.piece_names)
        result["credit"] = kv.plan.credit_bytes
    result.update({
        "bitwise": all(numpy.array_equal(a, b) for a, b in zip(got, ref, strict=True)),
        "max_diff": max(float(numpy.abs(a - b).max()) for a, b in zip(got, ref, strict=True)),
        "checksum": [float(sum(float(numpy.float64(a).sum()) for a in got)),
                     float(sum(float(numpy.float64(a).sum()) for a in ref))],
        "pieces": stats["pieces"],
        "mode": stats.get("mode"),
        "max_in_flight_bytes": stats["max_in_flight_bytes"],
        "order": {str(k): v["order"] for k, v in stats["per_step"].items()},
        "queued_while_pending": queued_while_pending,
    })
    return result


def make_plan(net, kind: str, rank: int):
    """A plan for ``net`` as the Trainer keys it (sorted parameter names): each key its own piece size,
    an order of its own, one piece "hierarchical" (plain push/pull on ps-lite). ``kind``: "good";
    "other_model" (the 40x48 weight as 48x40, as many elements); "differs" (rank 1 swaps two pieces);
    "fused" (the two last biases in one group); "priority" (the good plan with ``order`` priority:
    its pieces in rank 0's priority order)."""
    from commsched.plan import Plan, PlanGroup, PlannedPiece, PlannedTensor, fused_name

    entries = cmx.plan_model(net.collect_params())
    by_shape = {e.shape: e.name for e in entries}
    if kind == "other_model":
        i = [e.shape for e in entries].index((40, 48))
        e = entries[i]
        entries[i] = PlannedTensor(e.name, e.numel, e.element_size, (48, 40), e.dtype)
    # layer by layer, the last first (as backward makes them): (shape, piece size)
    layers = [[((10,), 1024), ((10, 40), 512)], [((40,), 64), ((40, 48), 1024)], [((48,), 1024), ((48, 32), 2048)]]
    groups = [PlanGroup(by_shape[shape], (by_shape[shape],), size) for layer in layers for shape, size in layer]
    if kind == "fused":
        small = (by_shape[(10,)], by_shape[(40,)])
        groups = [PlanGroup(fused_name(small), small, 1024)] + [g for g in groups if g.name not in small]
    order = []
    for g in groups:
        order += [(g.name, i) for i in range(len(piece_bounds_of(g, entries)))]
    first = (by_shape[(48, 32)], 0)
    order.insert(2, order.pop(order.index(first)))  # the first layer's first piece early: waits for it
    if kind == "differs" and rank == 1:
        order[3], order[4] = order[4], order[3]
    hierarchical = (by_shape[(40, 48)], 1)
    pieces = tuple(PlannedPiece(t, i, "hierarchical" if (t, i) == hierarchical else "ring") for t, i in order)
    return Plan(model=tuple(entries), groups=tuple(groups), pieces=pieces, credit_bytes=4096, nodes=1,
                ranks_per_node=2, order="priority" if kind == "priority" else "fixed")


def piece_bounds_of(group, entries):
    from commsched.partition import piece_bounds

    by_name = {e.name: e for e in entries}
    return piece_bounds(sum(by_name[t].numel for t in group.tensors), 4, group.partition_bytes)


def refused(inner, net, config, sc, data, name, opts) -> dict:
    """Run a plan every worker must refuse; record the error, where it came and how long it took."""
    result = {"scenario": sc, "rank": inner.rank, "refused": None}
    start = time.monotonic()
    kv = None
    try:
        kv = cmx.KVStore(inner, config, gate=sc.get("gate", "auto"))
        result["at"] = "training"
        trainer = gluon.Trainer(net.collect_params(), name, dict(opts), kvstore=kv)
        train(net, trainer, data[:1], sc)
    except Exception as exc:
        result["refused"] = f"{type(exc).__name__}: {exc}"
        result["is_plan_mismatch"] = isinstance(exc, commsched.plan.PlanMismatch)
        result["at"] = result.get("at", "construction")
    result["seconds"] = time.monotonic() - start
    if kv is not None:
        try:
            kv.close()
        except Exception as exc:  # the store fails with the error it refused the plan with
            result["close"] = type(exc).__name__
    return result


def mode_scenarios(args) -> list:
    inner = mx.kv.create("dist_sync")
    scenarios = [json.loads(s) for s in args.scenario]
    # A server-side optimizer applies to every key pushed after it is set: those last.
    scenarios.sort(key=lambda sc: bool(sc.get("update_on_kvstore")))
    results = []
    for index, sc in enumerate(scenarios):
        try:
            results.append(run_scenario(inner, index, sc))
        except Exception as exc:
            results.append({"scenario": sc, "rank": inner.rank, "error": f"{exc!r}\n{traceback.format_exc()}"})
    write(args.out, inner.rank, {"results": results, "threads_left": sorted(t.name for t in commsched_threads())})
    return results


def mode_order(args) -> None:
    """Keys pushed in opposite orders on the two ranks, one piece of credit: first with
    worker 0 deciding (must finish), then with 'fifo' (must deadlock and say so)."""
    inner = mx.kv.create("dist_sync")
    results = {}
    for ordering in ("dynamic", "fifo"):
        config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=1024, ordering=ordering, timeout_s=3)
        kv = cmx.KVStore(inner, config)
        keys = list(range(8))
        arrays = [mx.nd.full((1024,), float(k)) for k in keys]
        kv.init(keys, arrays)
        order = keys if kv.rank == 0 else keys[::-1]
        result = results[ordering] = {"rank": kv.rank}
        start = time.monotonic()
        try:
            for _ in range(3):
                for k in order:
                    arrays[k][:] = float(k) * (kv.rank + 1)
                    kv.pushpull(k, arrays[k], priority=-k)
                kv.synchronize()
            result["sums_ok"] = all(bool((a.asnumpy() == 3.0 * k).all()) for k, a in zip(keys, arrays, strict=True))
            result["error"] = None
        except commsched.CommschedError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["elapsed"] = time.monotonic() - start
        result["timeout_s"] = config.timeout_s
        if result["error"] is None:
            kv.close()
    write(args.out, inner.rank, results)
    # ps-lite still waits for pushes that will never match; leave without its shutdown.
    sys.stdout.flush()
    os._exit(0)


def mode_die(args) -> None:
    inner = mx.kv.create("dist_sync")
    config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, timeout_s=args.timeout_s)
    kv = cmx.KVStore(inner, config)
    net = make_net(7)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    data = batches(kv.rank, 50, 1)
    start = time.monotonic()
    try:
        for step, micro in enumerate(data):
            if step == 3:
                start = time.monotonic()  # elapsed counts from the step in which rank 1 dies
            if kv.rank == 1 and step == 3:
                os._exit(3)  # dies without a word, as a killed process does
            x, y = micro[0]
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(BATCH)
            loss.asnumpy()
    except Exception as exc:
        write(args.out, kv.rank, {"rank": kv.rank, "error_type": type(exc).__name__, "error": str(exc),
                                  "elapsed": time.monotonic() - start, "timeout_s": config.timeout_s})
        traceback.print_exc()
        # MXNet's own shutdown would now wait for the dead worker (ps-lite's final
        # barrier) until the launcher kills it; skip it to keep the test short.
        sys.stderr.flush()
        os._exit(1)
    write(args.out, kv.rank, {"rank": kv.rank, "error_type": None, "error": None})


def write(out: str, rank: int, payload) -> None:
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["scenarios", "order", "die"], default="scenarios")
    parser.add_argument("--scenario", action="append", default=[])
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args()
    {"scenarios": mode_scenarios, "order": mode_order, "die": mode_die}[args.mode](args)


if __name__ == "__main__":
    main()
