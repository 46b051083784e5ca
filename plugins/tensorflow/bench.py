"""Benchmark: stock MultiWorkerMirroredStrategy against commsched on an emulated cluster.

    python -m commsched.plugins.tensorflow.bench --json out/tensorflow.json       # netns, 1 Gbit/s links
    python -m commsched.plugins.tensorflow.bench --network loopback --json out/tensorflow.json

``add_arguments``/``run`` follow the ``commsched bench`` convention, so the CLI can
hand ``--framework tensorflow`` here. Topology: one node per worker (no parameter
server); every link is shaped with ``tc tbf`` (see :mod:`commsched.bench.netns`).
``TF_CONFIG`` lists the nodes' own namespace addresses. Each strategy is a fresh
job; worker 0 reports the median (and IQR) of the interval between consecutive
steps' losses becoming ready, after the warmup. Each worker runs TensorFlow with
one intra-op and one inter-op thread, on synthetic data with fixed seeds.

Strategies:

- ``mwms``: stock ``MultiWorkerMirroredStrategy``, Keras 3 custom loop, its own
  all-reduce (all gradients packed into one collective);
- ``dynamic``, ``static``: the same loop with commsched's ``DistributedOptimizer``
  (collective backend) and ``unroll(step, --unroll)`` for cross-iteration overlap
  (the plugin's recommended Keras 3 path, docs/tensorflow.md);
- ``horovod``: plain ``horovod.tensorflow.allreduce`` of every gradient (Horovod's
  defaults: tensor fusion, gloo), no ``tf.distribute``; skipped with a message when
  ``import horovod.tensorflow`` fails;
- ``hvd_dynamic``: commsched ``DistributedOptimizer(..., backend="horovod")``;
- ``compute``: the same model on one worker alone, no reduction;
- ``comm``: only MWMS's all-reduce of the gradients, step after step.

A perfect overlap approaches the larger of ``compute`` and ``comm``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from commsched.bench.cpu import BUSY_WARNING, CpuWindow
from commsched.bench.netns import make_cluster, parse_rate
from commsched.bench.options import add_mlp_bench_arguments, parse_strategy_list
from commsched.bench.procs import WorkerError, WorkerGroup, free_ports, horovod_gloo_rendezvous, signals_raise

__all__ = ["STRATEGIES", "add_arguments", "markdown", "run"]

log = logging.getLogger(__name__)

STRATEGIES = ("compute", "comm", "mwms", "dynamic", "static", "horovod", "hvd_dynamic")
DEFAULT_STRATEGIES = "compute,comm,mwms,dynamic,static,horovod"
MB = 1 << 20
INPUTS = 256
CLASSES = 10
#: TF gRPC port of every worker inside its own namespace (each namespace has its own ports).
NETNS_PORT = 12345


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the TensorFlow benchmark's flags to ``parser``."""
    add_mlp_bench_arguments(parser, strategies=STRATEGIES, default_strategies=DEFAULT_STRATEGIES, layers=5,
                            gradient_mb_hint="~18 MB", partition_mb=4.0, credit_mb=8.0,
                            partition_note=": see docs/tensorflow.md, Limits")
    parser.add_argument("--unroll", type=int, default=2,
                        help="steps per tf.function for dynamic/static (commsched's unroll; default 2)")


def run(args: argparse.Namespace) -> int:
    """Run every strategy, print a table, write the JSON report. Returns the exit status."""
    strategies, unknown = parse_strategy_list(args.strategies, STRATEGIES)
    if unknown:
        print(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}", file=sys.stderr)
        return 2
    if args.workers < 1 or args.steps < 2 or args.warmup < 1 or args.unroll < 1:
        print("need --workers >= 1, --steps >= 2, --warmup >= 1, --unroll >= 1", file=sys.stderr)
        return 2
    parse_rate(args.bandwidth)
    spec = {"hidden": args.hidden, "layers": args.layers, "batch_size": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "unroll": args.unroll, "partition_bytes": int(args.partition_mb * MB),
            "credit_bytes": int(args.credit_mb * MB), "timeout_s": args.timeout}
    rows: list[dict] = []
    note = ""
    with signals_raise():  # Ctrl-C / SIGTERM: the cluster's __exit__ kills the workers and deletes namespaces
        for strategy in strategies:
            with make_cluster(args.network, args.workers, args.bandwidth) as cluster:
                note = cluster.note
                row = _run_strategy(cluster, strategy, args.workers, spec, args.timeout)
            rows.append(row)
            print(_format_row(row), flush=True)
    base = next((r for r in rows if r["strategy"] == "mwms" and r.get("step_s")), None)
    for row in rows:
        if base and row.get("step_s"):
            row["vs_mwms"] = row["step_s"] / base["step_s"]
            row["speedup_vs_mwms"] = base["step_s"] / row["step_s"]
    report = {"framework": "tensorflow", "network": note, "bandwidth": args.bandwidth, "workers": args.workers,
              "spec": spec, "gradient_mb": _model_bytes(args.hidden, args.layers) / MB,
              "cpu_busy_warning": BUSY_WARNING, "results": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return 0 if all(r.get("step_s") or r.get("skipped") for r in rows) else 1


def _model_bytes(hidden: int, layers: int) -> int:
    params = INPUTS * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden * CLASSES + CLASSES
    return params * 4


def _worker_env(tf_config: dict | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CONFIG", "HOROVOD_"))}
    env.pop("TF_USE_LEGACY_KERAS", None)  # the Keras 3 custom loop
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def _run_strategy(cluster, strategy: str, workers: int, spec: dict, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"commsched-tfbench-{strategy}-"))
    nodes = cluster.nodes
    single = strategy == "compute"
    world = 1 if single else workers
    # Inside the run's own namespaces any port is free; on loopback ask the host.
    ports = [NETNS_PORT] * world if cluster.emulation == "netns" else free_ports(world)
    tf_cluster = {"worker": [f"{nodes[r].address}:{ports[r]}" for r in range(world)]}
    commands, envs, logs = [], [], []
    for rank in range(world):
        node = nodes[rank]
        spec_path = out / f"spec{rank}.json"
        spec_path.write_text(json.dumps({**spec, "strategy": strategy, "out": str(out), "rank": rank,
                                         "world": world, "ifname": node.ifname, "master_addr": nodes[0].address}))
        commands.append(node.wrap([sys.executable, "-m", "commsched.plugins.tensorflow.bench", "--worker",
                                   str(spec_path)]))
        tf_config = None if single or strategy in ("horovod", "hvd_dynamic") else \
            {"cluster": tf_cluster, "task": {"type": "worker", "index": rank}}
        envs.append(_worker_env(tf_config))
        logs.append(str(out / f"worker{rank}.log"))
    window = CpuWindow()
    status, error = 0, None
    group = WorkerGroup.start(commands, envs, logs)
    try:
        group.wait(timeout)
    except WorkerError as exc:
        status, error = 1, str(exc)
        log.error("%s failed: %s", strategy, exc)
    finally:
        group.kill()  # by pid; a no-op when all exited
    cpu = window.stop()
    row = {"strategy": strategy, "status": status, "cpu_busy": cpu["cpu_busy"], "wall_s": cpu["wall_s"],
           "logs": str(out)}
    if error:
        row["error"] = error[-2000:]
    result_path = out / "rank0.json"
    if result_path.exists():
        row.update(json.loads(result_path.read_text()))
    return row


def _format_row(row: dict) -> str:
    if row.get("skipped"):
        return f"{row['strategy']:>12}: skipped ({row['skipped']})"
    if not row.get("step_s"):
        return f"{row['strategy']:>12}: failed (status {row['status']}, logs in {row['logs']})"
    warn = "  WARNING: CPU-bound" if (row["cpu_busy"] or 0) > BUSY_WARNING else ""
    return (f"{row['strategy']:>12}: {row['step_s'] * 1000:8.1f} ms/step, IQR {row['iqr_s'] * 1000:.1f} ms  "
            f"(cpu busy {row['cpu_busy'] or 0:.2f}, {row.get('pieces_per_step', 0):.0f} pieces/step){warn}")


def markdown(report: dict) -> str:
    """The report as a Markdown table."""
    lines = [f"TensorFlow, {report['workers']} workers, {report['network']}, "
             f"{report['gradient_mb']:.1f} MB of gradients per step, {report['spec']['steps']} measured steps "
             f"after {report['spec']['warmup']} warmup", "",
             "| strategy | step (ms) | IQR (ms) | speedup vs mwms | CPU busy | pieces/step |",
             "|---|---|---|---|---|---|"]
    busy = []
    for row in report["results"]:
        if row.get("skipped"):
            lines.append(f"| {row['strategy']} | skipped: {row['skipped']} | | | | |")
            continue
        if not row.get("step_s"):
            lines.append(f"| {row['strategy']} | failed | | | | |")
            continue
        ratio = f"{row['speedup_vs_mwms']:.2f}" if "speedup_vs_mwms" in row else ""
        cpu = row["cpu_busy"] or 0
        if cpu > report["cpu_busy_warning"]:
            busy.append(row["strategy"])
        lines.append(f"| {row['strategy']} | {row['step_s'] * 1000:.1f} | {row['iqr_s'] * 1000:.1f} | {ratio} | "
                     f"{cpu:.2f}{' (!)' if cpu > report['cpu_busy_warning'] else ''} | "
                     f"{row.get('pieces_per_step', 0):.0f} |")
    if busy:
        lines += ["", f"WARNING: CPU busy above {report['cpu_busy_warning']} for {', '.join(busy)}: those timings "
                      "measure the CPU rather than the network."]
    return "\n".join(lines)


# ---------------------------------------------------------------- worker side
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
    if strategy in ("horovod", "hvd_dynamic"):
        try:
            import horovod.tensorflow  # noqa: F401
        except Exception as exc:  # noqa: BLE001 (a missing or mis-built C extension raises various errors)
            if rank == 0:
                why = f"import horovod.tensorflow fails ({type(exc).__name__}: {exc}); build it with `make horovod`"
                (Path(spec["out"]) / "rank0.json").write_text(json.dumps({"skipped": why}))
            return 0

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import commsched
    from commsched.plugins.tensorflow import DistributedOptimizer, unroll

    if strategy in ("horovod", "hvd_dynamic"):
        hvd = _init_horovod(spec)
    mwms = strategy in ("mwms", "comm", "dynamic", "static")
    dist = tf.distribute.MultiWorkerMirroredStrategy() if mwms else tf.distribute.get_strategy()
    world = spec["world"]
    batch = spec["batch_size"]
    global_batch = batch * world
    config = commsched.SchedulerConfig(partition_bytes=spec["partition_bytes"], credit_bytes=spec["credit_bytes"],
                                       ordering=strategy if strategy in ("dynamic", "static") else "dynamic",
                                       timeout_s=spec["timeout_s"])
    with dist.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((INPUTS,))]
                                 + [keras.layers.Dense(spec["hidden"], activation="relu")
                                    for _ in range(spec["layers"])]
                                 + [keras.layers.Dense(CLASSES)])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        if strategy in ("dynamic", "static"):
            opt = DistributedOptimizer(opt, config=config)
        elif strategy == "hvd_dynamic":
            opt = DistributedOptimizer(opt, config=config, backend="horovod")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    rng = np.random.default_rng(rank)
    xs = rng.standard_normal((4 * batch, INPUTS)).astype("float32")
    ys = rng.integers(0, CLASSES, 4 * batch).astype("int32")
    iterator = iter(tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch).repeat())
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

    per_call = spec["unroll"] if strategy in ("dynamic", "static") else 1
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
        call = tf.function(one_step)

    def wait(result) -> None:
        last = result[-1] if isinstance(result, list) else result
        for t in dist.experimental_local_results(last) if mwms else [last]:
            t.numpy()

    calls_warm = -(-spec["warmup"] // per_call)
    calls = max(2, -(-spec["steps"] // per_call)) + 1  # intervals between consecutive calls
    ready = []
    for i in range(calls_warm + calls):
        wait(call(iterator))
        if i >= calls_warm:
            ready.append(time.perf_counter())
    intervals = [(b - a) / per_call for a, b in zip(ready[:-1], ready[1:], strict=True)]
    q = statistics.quantiles(intervals, n=4) if len(intervals) >= 2 else [intervals[0]] * 3
    result = {"step_s": statistics.median(intervals), "iqr_s": q[2] - q[0], "mean_step_s": statistics.mean(intervals),
              "steps": len(intervals) * per_call, "unroll": per_call, "world": world}
    reducer = getattr(opt, "_commsched", None)
    if reducer is not None and reducer.plans:
        result["pieces_per_step"] = len(reducer.plans[-1].pieces)
    if rank == 0:
        (Path(spec["out"]) / "rank0.json").write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m commsched.plugins.tensorflow.bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        code = _worker(argv[1])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # do not wait for the other workers (or Horovod/TF teardown) at exit
    parser = argparse.ArgumentParser(prog="python -m commsched.plugins.tensorflow.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
