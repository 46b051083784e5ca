"""One worker of the TensorFlow benchmark: ``python -m commsched.plugins.tensorflow.bench.worker SPEC``.

Trains the MLP of :mod:`.workloads` under one strategy (see :mod:`.strategies`)
and, on rank 0, writes ``rank0.json`` in the run directory: the intervals
between consecutive steps (``step_times_s``), ``world`` and ``pieces_per_step``,
or ``{"skipped": why}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from commsched.plugins.horovod_gloo import horovod_gloo_rendezvous
from commsched.plugins.tensorflow.bench.strategies import HOROVOD_STRATEGIES
from commsched.plugins.tensorflow.bench.workloads import build_model, synthetic_data


def _init_horovod(spec: dict):
    """``hvd.init()`` through a gloo rendezvous, as ``horovodrun --gloo`` would."""
    import horovod.tensorflow as hvd

    os.environ.update(horovod_gloo_rendezvous(
        rank=spec["rank"], world_size=spec["world"], nodes=spec["world"], run_dir=spec["out"],
        master_addr=spec["master_addr"], ifname=spec["ifname"],
    ))
    hvd.init()
    return hvd


def _worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    strategy, rank = spec["strategy"], spec["rank"]
    hvd = None
    if strategy in HOROVOD_STRATEGIES:
        try:
            import horovod.tensorflow  # noqa: F401
        except Exception as exc:  # noqa: BLE001 (a missing or mis-built C extension raises various errors)
            if rank == 0:
                why = f"import horovod.tensorflow fails ({type(exc).__name__}: {exc}); build it with `make horovod`"
                (Path(spec["out"]) / "rank0.json").write_text(json.dumps({"skipped": why}))
            return 0

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import commsched
    from commsched.plugins.tensorflow import DistributedOptimizer, function, unroll
    from commsched.plugins.tensorflow.functions import RETRACE_AT_CALL

    if strategy in HOROVOD_STRATEGIES:
        hvd = _init_horovod(spec)
    mwms = strategy in ("mwms", "comm", "dynamic", "static")
    dist = tf.distribute.MultiWorkerMirroredStrategy() if mwms else tf.distribute.get_strategy()
    world = spec["world"]
    batch = spec["batch_size"]
    global_batch = batch * world
    config = commsched.SchedulerConfig(partition_bytes=spec["partition_bytes"], credit_bytes=spec["credit_bytes"],
                                       ordering="static" if strategy == "static" else "dynamic",
                                       timeout_s=spec["timeout_s"])
    with dist.scope():
        model = build_model(spec["hidden"], spec["layers"])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        if strategy in ("dynamic", "static"):
            opt = DistributedOptimizer(opt, config=config)
        elif strategy == "hvd_dynamic":
            opt = DistributedOptimizer(opt, config=config, backend="horovod")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    iterator = synthetic_data(rank, batch)
    variables = model.trainable_variables

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model(xb, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, variables)
        if strategy == "horovod":  # loss already divided by the global batch: sum. Horovod fuses the tensors.
            # (hvd.DistributedGradientTape does the same but needs tf.Variable.ref(), which Keras 3 lacks)
            grads = [hvd.allreduce(g, op=hvd.Sum, name=f"grad{i}") for i, g in enumerate(grads)]
        opt.apply_gradients(zip(grads, variables, strict=True))
        return loss

    def one_step(it):
        xb, yb = next(it)
        return dist.run(train_step, args=(xb, yb)) if mwms else train_step(xb, yb)

    per_call = spec["unroll"] if strategy in ("dynamic", "static", "hvd_dynamic") else 1
    if strategy == "comm":  # gradients once, then only MWMS's all-reduce of them, step after step
        def grads_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
            return tape.gradient(loss, variables)

        xb, yb = next(iterator)
        grads = dist.run(tf.function(grads_fn), args=(xb, yb))

        @tf.function
        def call(_it):
            def reduce_all(*g):
                reduced = tf.distribute.get_replica_context().all_reduce("sum", list(g))
                return tf.add_n([tf.reduce_sum(r) for r in reduced])  # ready when every gradient is

            return dist.run(reduce_all, args=tuple(grads))
    elif per_call > 1:
        call = unroll(one_step, per_call)
    else:
        call = function(one_step)

    def wait(result) -> None:
        last = result[-1] if isinstance(result, list) else result
        for t in dist.experimental_local_results(last) if mwms else [last]:
            t.numpy()

    calls_warm = -(-spec["warmup"] // per_call)
    calls = max(2, -(-spec["steps"] // per_call)) + 1  # intervals between consecutive calls
    ready = []
    if strategy == "static":
        # unroll()/function() trace the step again at call RETRACE_AT_CALL, planned from the order and
        # link rate the first trace's graph measured (docs/tensorflow.md, step 2): keep that in the warm-up
        calls_warm = max(calls_warm, RETRACE_AT_CALL)
    for i in range(calls_warm + calls):
        wait(call(iterator))
        if i >= calls_warm:
            ready.append(time.perf_counter())
    intervals = [(b - a) / per_call for a, b in zip(ready[:-1], ready[1:], strict=True)]
    result = {"step_times_s": intervals, "world": world, "unroll": per_call}
    reducer = getattr(opt, "commsched", None)  # the wrapped optimizer's declared GradientReducer
    if reducer is not None and reducer.plans:
        result["pieces_per_step"] = len(reducer.plans[-1].pieces)
        result["stats"] = dict(reducer.stats(), last_step_pieces=_last_step_pieces(reducer))
    if rank == 0:
        (Path(spec["out"]) / "rank0.json").write_text(json.dumps(result))
    _all_done(Path(spec["out"]), rank, world if strategy != "compute" else 1)
    return 0


def _all_done(out: Path, rank: int, world: int, timeout_s: float = 30.0) -> None:
    """Stay until every worker finished its last step (a file each in the run's directory): a worker
    that exits at once closes its gRPC server while another may still be fetching its share of the
    last collective (measured: MWMS's rank 1 failed once with "Socket closed" from worker 0)."""
    (out / f"done.{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all((out / f"done.{r}").exists() for r in range(world)):
        time.sleep(0.05)


def _last_step_pieces(reducer) -> list[dict]:
    """The graph's stamps of the last measured step, per piece in plan order: name, bytes, chain
    (``slot``; negative: off the chains), and ready, issue and done in seconds from the step's start
    (worker 0's clock; issue = max(ready, done of the previous piece on the chain))."""
    record = reducer.records[-1]
    runs = record.recorder.runs()
    if record.recorder.unmeasured or not runs:
        return []
    run = runs[-1]
    issue = run.issue
    return [{"name": p.name, "bytes": p.nbytes, "slot": p.slot, "ready_s": float(run.ready[k] - run.start),
             "issue_s": float(issue[k] - run.start), "done_s": float(run.done[k] - run.start)}
            for k, p in enumerate(record.plan.pieces)]


def main(argv: list[str] | None = None) -> int:
    """Run the worker of the spec file ``argv[0]``; exits without waiting for TF/Horovod teardown."""
    argv = list(sys.argv[1:] if argv is None else argv)
    code = _worker(argv[0])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait for the other workers (or Horovod/TF teardown) at exit


if __name__ == "__main__":
    main()
