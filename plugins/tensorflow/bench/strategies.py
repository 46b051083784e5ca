"""Benchmark: stock MultiWorkerMirroredStrategy against commsched on an emulated cluster.

    commsched bench --framework tensorflow --json out/tensorflow.json       # netns, 1 Gbit/s links
    python -m commsched.plugins.tensorflow.bench --network loopback --json out/tensorflow.json

``add_arguments``/``run`` follow the ``commsched bench`` convention, so the CLI can
hand ``--framework tensorflow`` here; the loop, the report and the table are the
framework-free :func:`commsched.bench.cli.run_strategies` (docs/bench.md). This
module imports no TensorFlow: the worker is :mod:`.worker`. Topology: one node per worker (no parameter
server); every link is shaped with ``tc tbf`` (see :mod:`commsched.bench.netns`).
``TF_CONFIG`` lists the nodes' own namespace addresses. Each strategy is a fresh
job; worker 0 reports the intervals between consecutive steps' losses becoming
ready, after the warmup (the report takes their median and IQR). Each worker runs TensorFlow with
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
- ``hvd_dynamic``: commsched ``DistributedOptimizer(..., backend="horovod")``, unrolled
  as ``dynamic`` is (``--unroll``); ``static`` traces its step again at call 4, planned
  from the order observed (docs/tensorflow.md, step 2);
- ``compute``: the same model on one worker alone, no reduction;
- ``comm``: only MWMS's all-reduce of the gradients, step after step.

A perfect overlap approaches the larger of ``compute`` and ``comm``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from commsched.bench.cli import run_strategies, standalone_main
from commsched.bench.options import add_mlp_bench_arguments
from commsched.bench.procs import WorkerError, WorkerGroup, free_ports
from commsched.plugins.tensorflow.bench.workloads import describe

__all__ = ["DEFAULT_STRATEGIES", "HOROVOD_STRATEGIES", "STRATEGIES", "add_arguments", "run"]

log = logging.getLogger(__name__)

STRATEGIES = ("compute", "comm", "mwms", "dynamic", "static", "horovod", "hvd_dynamic")
DEFAULT_STRATEGIES = "compute,comm,mwms,dynamic,static,horovod"
#: Strategies that run Horovod instead of tf.distribute (no TF_CONFIG).
HOROVOD_STRATEGIES = ("horovod", "hvd_dynamic")
MB = 1 << 20
#: TF gRPC port of every worker inside its own namespace (each namespace has its own ports).
NETNS_PORT = 12345


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the TensorFlow benchmark's flags to ``parser``."""
    add_mlp_bench_arguments(parser, strategies=STRATEGIES, default_strategies=DEFAULT_STRATEGIES, layers=5,
                            gradient_mb_hint="~18 MB", partition_mb=4.0, credit_mb=16.0,
                            partition_note=": see docs/tensorflow.md, Limits")
    parser.add_argument("--unroll", type=int, default=2,
                        help="steps per tf.function for dynamic/static/hvd_dynamic (commsched's unroll; default 2)")


def run(args: argparse.Namespace) -> int:
    """Run every strategy, print the table, write the JSON report. Returns the exit status."""
    if args.workers < 1 or args.steps < 2 or args.warmup < 1 or args.unroll < 1:
        print("commsched bench: need --workers >= 1, --steps >= 2, --warmup >= 1, --unroll >= 1", file=sys.stderr)
        return 2
    spec = {"hidden": args.hidden, "layers": args.layers, "batch_size": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "unroll": args.unroll, "partition_bytes": int(args.partition_mb * MB),
            "credit_bytes": int(args.credit_mb * MB), "timeout_s": args.timeout}

    def launch(cluster, strategy: str, out: Path) -> str | None:
        return _run_strategy(cluster, strategy, args.workers, spec, args.timeout, out)

    return run_strategies(args, framework="tensorflow", allowed=STRATEGIES, nodes=args.workers, launch=launch,
                          workload=describe(args.hidden, args.layers),
                          extra={"hidden": args.hidden, "layers": args.layers, "unroll": args.unroll,
                                 "timeout_s": args.timeout})


def _worker_env(tf_config: dict | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CONFIG", "HOROVOD_"))}
    env.pop("TF_USE_LEGACY_KERAS", None)  # the Keras 3 custom loop
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def _run_strategy(cluster, strategy: str, workers: int, spec: dict, timeout: float, out: Path) -> str | None:
    """One job of ``strategy``: ``None`` when every worker exited 0, else why not."""
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
        commands.append(node.wrap([sys.executable, "-m", "commsched.plugins.tensorflow.bench.worker",
                                   str(spec_path)]))
        tf_config = None if single or strategy in HOROVOD_STRATEGIES else \
            {"cluster": tf_cluster, "task": {"type": "worker", "index": rank}}
        envs.append(_worker_env(tf_config))
        logs.append(str(out / f"worker{rank}.log"))
    group = WorkerGroup.start(commands, envs, logs)
    try:
        group.wait(timeout)
    except WorkerError as exc:
        log.error("%s failed: %s", strategy, exc)
        return str(exc)
    finally:
        group.kill()  # by pid; a no-op when all exited
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m commsched.plugins.tensorflow.bench``: the flags of ``commsched bench --framework tensorflow``."""
    return standalone_main("python -m commsched.plugins.tensorflow.bench", __doc__, add_arguments, run, argv)
