"""Benchmark: plain ``dist_sync`` against the commsched KVStore on an emulated cluster.

    commsched bench --framework mxnet --json out/mxnet.json            # netns, 1 Gbit/s links
    python -m commsched.plugins.mxnet.bench --network loopback --json out/mxnet.json

``add_arguments``/``run`` follow the ``commsched bench`` convention, so the CLI can
hand ``--framework mxnet`` here; the loop, the report and the table are the
framework-free :func:`commsched.bench.cli.run_strategies` (docs/bench.md), which
also tears the namespaces down on Ctrl-C, SIGTERM and SIGHUP. This module
imports no MXNet: the worker is :mod:`.worker`. Topology: node 0 holds the ps-lite scheduler and
the server (the parameter-server machine), nodes 1..N one worker each; every
link is shaped with ``tc tbf`` (see :mod:`commsched.bench.netns`), so the server's
link carries every worker's push and pull. Each strategy is a fresh job; worker 0
reports the intervals between consecutive losses becoming ready (the usual
per-step metric read); the report takes their median and IQR. ``compute`` runs the same
model alone, without any KVStore, and ``comm`` only the plain dist_sync push/pull
of the gradients: a perfect overlap approaches the larger of the two.

Strategies: ``dist_sync`` (plain, local update), ``dist_sync_server`` (plain,
optimizer on the server: the Trainer's default for dist_sync), ``fifo``,
``dynamic``, ``static`` (commsched orderings, local update), ``dynamic_server``
(commsched with update_on_kvstore=True), ``compute``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from commsched.bench.cli import run_strategies, standalone_main
from commsched.bench.options import add_mlp_bench_arguments
from commsched.bench.procs import free_ports
from commsched.plugins.mxnet.bench.workloads import describe
from commsched.plugins.mxnet.launch import Job

__all__ = ["DEFAULT_STRATEGIES", "STRATEGIES", "add_arguments", "run"]

log = logging.getLogger(__name__)

STRATEGIES = ("compute", "comm", "dist_sync", "dist_sync_server", "fifo", "dynamic", "static", "dynamic_server")
DEFAULT_STRATEGIES = "compute,comm,dist_sync,dist_sync_server,fifo,dynamic"
MB = 1 << 20
#: ps-lite scheduler port inside the run's own namespaces (each namespace has its own ports).
NETNS_PORT = 9091
WORKER_MODULE = "commsched.plugins.mxnet.bench.worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the MXNet benchmark's flags to ``parser``."""
    add_mlp_bench_arguments(parser, strategies=STRATEGIES, default_strategies=DEFAULT_STRATEGIES, layers=6,
                            gradient_mb_hint="~25 MB", partition_mb=1.0, credit_mb=4.0)


def run(args: argparse.Namespace) -> int:
    """Run every strategy, print the table, write the JSON report. Returns the exit status."""
    if args.workers < 1 or args.steps < 2 or args.warmup < 0:
        print("commsched bench: need --workers >= 1, --steps >= 2, --warmup >= 0", file=sys.stderr)
        return 2
    spec = {"hidden": args.hidden, "layers": args.layers, "batch_size": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "partition_bytes": int(args.partition_mb * MB),
            "credit_bytes": int(args.credit_mb * MB)}

    def launch(cluster, strategy: str, out: Path) -> str | None:
        return _run_strategy(cluster, strategy, args.workers, spec, args.timeout, out)

    return run_strategies(args, framework="mxnet", allowed=STRATEGIES, nodes=args.workers + 1, launch=launch,
                          workload=describe(args.hidden, args.layers),
                          extra={"hidden": args.hidden, "layers": args.layers, "servers": 1,
                                 "timeout_s": args.timeout})


def _run_strategy(cluster, strategy: str, workers: int, spec: dict, timeout: float, out: Path) -> str | None:
    """One job of ``strategy``: ``None`` when it exited 0, else why not."""
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "strategy": strategy, "out": str(out), "world": workers}))
    worker_cmd = [sys.executable, "-m", WORKER_MODULE, str(spec_path)]
    nodes = cluster.nodes
    if strategy == "compute":
        env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
        proc = subprocess.run(nodes[1].wrap(worker_cmd), env=env, timeout=timeout, capture_output=True, text=True)
        if proc.returncode:
            return f"compute run exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        return None
    # Inside the run's own namespaces any port is free; on loopback ask the host.
    port = NETNS_PORT if cluster.emulation == "netns" else free_ports(1)[0]
    job = Job(worker_cmd, workers=workers, servers=1, host=nodes[0].address, port=port,
              place=lambda role, index: _placement(cluster, role, index))
    try:
        job.start()
        status = job.wait(timeout, grace=10.0)
    finally:
        job.stop()
    return None if status == 0 else f"the job exited {status} (worker logs in {out})"


def _placement(cluster, role: str, index: int) -> tuple[list[str], dict[str, str]]:
    node = cluster.nodes[0] if role in ("scheduler", "server") else cluster.nodes[1 + index]
    env = {"DMLC_NODE_HOST": node.address}
    if node.namespace is not None:
        env["DMLC_INTERFACE"] = node.ifname
    return node.wrap([]), env


def main(argv: list[str] | None = None) -> int:
    """``python -m commsched.plugins.mxnet.bench``: the flags of ``commsched bench --framework mxnet``."""
    return standalone_main("python -m commsched.plugins.mxnet.bench", __doc__, add_arguments, run, argv)
