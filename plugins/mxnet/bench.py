"""Benchmark: plain ``dist_sync`` against the commsched KVStore on an emulated cluster.

    python -m commsched.plugins.mxnet.bench --json out/mxnet.json            # netns, 1 Gbit/s links
    python -m commsched.plugins.mxnet.bench --network loopback --json out/mxnet.json

``add_arguments``/``run`` follow the ``commsched bench`` convention, so the CLI can
hand ``--framework mxnet`` here. Topology: node 0 holds the ps-lite scheduler and
the server (the parameter-server machine), nodes 1..N one worker each; every
link is shaped with ``tc tbf`` (see :mod:`commsched.bench.netns`), so the server's
link carries every worker's push and pull. Each strategy is a fresh job; worker 0
reports the median step time, measured as the interval between consecutive
losses becoming ready (the usual per-step metric read). ``compute`` runs the same
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
import statistics
import sys
import tempfile
import time
from pathlib import Path

from commsched.bench.cpu import CpuWindow
from commsched.bench.netns import make_cluster, parse_rate
from commsched.bench.options import add_mlp_bench_arguments, parse_strategy_list
from commsched.bench.procs import free_ports
from commsched.plugins.mxnet.launch import Job

__all__ = ["STRATEGIES", "add_arguments", "run"]

log = logging.getLogger(__name__)

STRATEGIES = ("compute", "comm", "dist_sync", "dist_sync_server", "fifo", "dynamic", "static", "dynamic_server")
DEFAULT_STRATEGIES = "compute,comm,dist_sync,dist_sync_server,fifo,dynamic"
MB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the MXNet benchmark's flags to ``parser``."""
    add_mlp_bench_arguments(parser, strategies=STRATEGIES, default_strategies=DEFAULT_STRATEGIES, layers=6,
                            gradient_mb_hint="~25 MB", partition_mb=1.0, credit_mb=4.0)


def run(args: argparse.Namespace) -> int:
    """Run every strategy, print a table, write the JSON report. Returns the exit status."""
    strategies, unknown = parse_strategy_list(args.strategies, STRATEGIES)
    if unknown:
        print(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}", file=sys.stderr)
        return 2
    parse_rate(args.bandwidth)
    spec = {"hidden": args.hidden, "layers": args.layers, "batch_size": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "partition_bytes": int(args.partition_mb * MB),
            "credit_bytes": int(args.credit_mb * MB)}
    rows = []
    note = ""
    for strategy in strategies:
        with make_cluster(args.network, args.workers + 1, args.bandwidth) as cluster:
            note = cluster.note
            row = _run_strategy(cluster, strategy, args.workers, spec, args.timeout)
        rows.append(row)
        print(_format_row(row, rows[0] if rows else None), flush=True)
    base = next((r for r in rows if r["strategy"] == "dist_sync" and r.get("step_s")), None)
    for row in rows:
        if base and row.get("step_s"):
            row["vs_dist_sync"] = row["step_s"] / base["step_s"]
    report = {"framework": "mxnet", "network": note, "bandwidth": args.bandwidth, "workers": args.workers,
              "spec": spec, "gradient_mb": _model_bytes(args.hidden, args.layers) / MB, "results": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(markdown(report))
    return 0 if all(r.get("step_s") for r in rows) else 1


def _model_bytes(hidden: int, layers: int) -> int:
    inputs = 256
    params = inputs * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden * 10 + 10
    return params * 4


def _run_strategy(cluster, strategy: str, workers: int, spec: dict, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"commsched-mxbench-{strategy}-"))
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "strategy": strategy, "out": str(out)}))
    worker_cmd = [sys.executable, "-m", "commsched.plugins.mxnet.bench", "--worker", str(spec_path)]
    nodes = cluster.nodes
    window = CpuWindow()
    status = 0
    if strategy == "compute":
        import subprocess
        env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
        proc = subprocess.run(nodes[1].wrap(worker_cmd), env=env, timeout=timeout, capture_output=True, text=True)
        status = proc.returncode
        if status:
            log.error("compute run failed:\n%s", proc.stdout[-2000:] + proc.stderr[-2000:])
    else:
        # Inside the run's own namespaces any port is free; on loopback ask the host.
        port = 9091 if cluster.emulation == "netns" else free_ports(1)[0]
        job = Job(worker_cmd, workers=workers, servers=1, host=nodes[0].address, port=port,
                  place=lambda role, index: _placement(cluster, role, index))
        try:
            job.start()
            status = job.wait(timeout, grace=10.0)
        finally:
            job.stop()
    cpu = window.stop()
    row = {"strategy": strategy, "status": status, "cpu_busy": cpu["cpu_busy"], "wall_s": cpu["wall_s"]}
    result_path = out / "rank0.json"
    if result_path.exists():
        row.update(json.loads(result_path.read_text()))
    return row


def _placement(cluster, role: str, index: int) -> tuple[list[str], dict[str, str]]:
    node = cluster.nodes[0] if role in ("scheduler", "server") else cluster.nodes[1 + index]
    env = {"DMLC_NODE_HOST": node.address}
    if node.namespace is not None:
        env["DMLC_INTERFACE"] = node.ifname
    return node.wrap([]), env


def _format_row(row: dict, first: dict | None) -> str:
    if not row.get("step_s"):
        return f"{row['strategy']:>18}: failed (status {row['status']})"
    return (f"{row['strategy']:>18}: {row['step_s'] * 1000:8.1f} ms/step  "
            f"(cpu busy {row['cpu_busy'] or 0:.2f}, {row.get('pieces_per_step', 0):.0f} pieces/step)")


def markdown(report: dict) -> str:
    """The report as a Markdown table."""
    lines = [f"MXNet, {report['workers']} workers + 1 server, {report['network']}, "
             f"{report['gradient_mb']:.1f} MB of gradients per step", "",
             "| strategy | step (ms) | vs dist_sync | CPU busy | pieces/step |", "|---|---|---|---|---|"]
    for row in report["results"]:
        if not row.get("step_s"):
            lines.append(f"| {row['strategy']} | failed | | | |")
            continue
        ratio = f"{row['vs_dist_sync']:.2f}" if "vs_dist_sync" in row else ""
        lines.append(f"| {row['strategy']} | {row['step_s'] * 1000:.1f} | {ratio} | {row['cpu_busy'] or 0:.2f} | "
                     f"{row.get('pieces_per_step', 0):.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- worker side
def _worker(spec_path: str) -> None:
    import numpy

    if "bool" not in numpy.__dict__:  # mxnet 1.9.1 on numpy >= 1.24 (entry point)
        numpy.bool = numpy.bool_
    import mxnet as mx
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

    mx.random.seed(0)
    net = gluon.nn.Sequential()
    for _ in range(spec["layers"]):
        net.add(gluon.nn.Dense(spec["hidden"], activation="relu"))
    net.add(gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 256)))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9}, kvstore=kv,
                            **trainer_args)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rs = numpy.random.RandomState(rank)
    batch = spec["batch_size"]
    data = [(mx.nd.array(rs.randn(batch, 256)), mx.nd.array(rs.randint(0, 10, batch))) for _ in range(4)]
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
    result = {"step_s": statistics.median(intervals), "mean_step_s": statistics.mean(intervals),
              "steps": len(intervals)}
    if isinstance(kv, cmx.KVStore):
        stats = kv.stats()
        result["pieces_per_step"] = stats["pieces"] / total
        kv.close()
    if rank == 0:
        (Path(spec["out"]) / "rank0.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    """``python -m commsched.plugins.mxnet.bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1])
        return 0
    parser = argparse.ArgumentParser(prog="python -m commsched.plugins.mxnet.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
