#!/usr/bin/env python3
"""Soak: many steps on a small model, 2 workers, watching memory, threads and store keys.

Each worker trains ``--steps`` steps of a small MLP with commsched (small pieces, small
credit, so every step starts many pieces) and samples, every ``--every`` steps, its
resident set size (``/proc/self/statm``), its thread count (``/proc/self/status``) and,
where the backend has a store commsched writes to, the number of keys in it (read on the
worker that hosts it). The baseline is the sample after warm-up (``--warmup`` steps:
allocators, the static plan, lazy imports, TensorFlow's traces).

Backends and what "store keys" counts on each (``STORE_KEYS``):

* ``torch``: torch/gloo; c10d's rendezvous store on rank 0: ``num_keys``, and apart (c10d's
  queues are not keys) the decisions waiting in rank 1's order queue, reported as
  ``queued_max``/``queued_last`` but not judged (a backlog at a sample depends on timing).
* ``horovod``: torch on Horovod over gloo; no store: Horovod's rank-0 coordinator orders
  the pieces by name, commsched writes nothing to Horovod's rendezvous server.
* ``tensorflow``: TF collective ops under ``MultiWorkerMirroredStrategy`` (2 workers,
  ``TF_CONFIG`` on 127.0.0.1); no store: collectives are matched by group/instance key,
  drawn from an in-graph counter (``plugins/tensorflow/keys.py``).
* ``mxnet``: the commsched KVStore on ps-lite ``dist_sync`` (2 workers, 1 server, the
  scheduler, started by ``commsched launch mxnet``); commsched's order store, served by
  worker 0 (``StoreServer.data_keys``), and apart the decisions queued for worker 1
  (``StoreServer.queued_values``: reported as ``queued_max``/``queued_last``, not judged).

Pass criteria (issue 14's): RSS at the end less than 5 % above the baseline, the thread
count the same at every sample after warm-up (except gRPC's ``event_engine`` pool under
TensorFlow, which starts a thread when busy: reported, bounded by ``POOL_LIMIT``), the
store's key count the same at every sample after warm-up (bounded: queues are popped,
nothing accumulates), and every process exits with status 0 by itself.

Usage::

    python scripts/soak.py --steps 2000 --out soak.json                 # every backend
    python scripts/soak.py --backends torch --steps 200                 # what CI runs
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("torch", "horovod", "tensorflow", "mxnet")
RSS_GROWTH_LIMIT = 0.05
#: Kernel thread-name prefixes of a framework's own on-demand pools: gRPC's event engine under
#: TensorFlow's collectives starts a worker thread when it is busy (seen: one more, once, in 2,000
#: steps, with commsched's piece timestamps off too). They may vary, up to POOL_LIMIT threads; every
#: other thread must stay constant.
FRAMEWORK_POOLS = ("event_engine",)
POOL_LIMIT = 16
STORE_KEYS = {
    "torch": "keys in c10d's rendezvous store (rank 0); queued_max/queued_last: rank 1's order queue",
    "horovod": "none: Horovod orders pieces in its coordinator; commsched keeps nothing in a store",
    "tensorflow": "none: TF collectives are matched by group/instance keys from an in-graph counter",
    "mxnet": "keys in commsched's order store (served by worker 0); queued_max/queued_last: its queued decisions",
}


def sample(store_keys=None, queued=None) -> dict:
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * page
    threads = None
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
    names: dict[str, int] = {}  # threads by kernel name (what grew, when something does)
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as fh:
                name = fh.read().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    pools = sum(n for name, n in names.items() if name.startswith(FRAMEWORK_POOLS))  # on-demand pools
    return {"rss_bytes": rss, "threads": threads, "pool_threads": pools, "thread_names": names,
            "store_keys": store_keys() if store_keys is not None else None,
            "queued": queued() if queued is not None else None}


def soak_config(args: argparse.Namespace):
    """Small pieces and a small credit, so every step starts many pieces; the same on every backend."""
    import commsched

    return commsched.SchedulerConfig(partition_bytes=2048, credit_bytes=8192, ordering=args.ordering,
                                     timeout_s=args.timeout_s)


def write_result(outdir: str, rank: int, payload: dict) -> None:
    path = Path(outdir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, **payload}))
    os.replace(tmp, path)


def worker_torch(args: argparse.Namespace) -> None:
    import torch
    import torch.nn as nn

    from commsched.plugins.torch import DistributedOptimizer

    torch.set_num_threads(1)
    store_keys = queued = None
    if args.worker == "horovod":
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        if rank == 0:
            store = dist.distributed_c10d._get_default_store()
            store_keys = store.num_keys
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    config = soak_config(args)
    samples = []
    with DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model, backend=args.worker,
                              config=config) as opt:
        if args.worker == "torch" and rank == 0:
            # c10d's queues are not keys (num_keys misses them): the follower's order queue, apart
            queue = f"{opt._prefix}/q1"
            queued = lambda: store.queue_len(queue)  # noqa: E731
        g = torch.Generator().manual_seed(rank)
        for step in range(args.steps):
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            if step % args.every == 0 or step == args.steps - 1:
                samples.append(dict(step=step, **sample(store_keys, queued)))
        opt.synchronize()
        pieces = opt.stats()["pieces"]
    write_result(args.out, rank, {"samples": samples, "pieces": pieces, "after_close": sample(store_keys)})
    if args.worker == "torch":
        dist.destroy_process_group()


def worker_tensorflow(args: argparse.Namespace) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    from commsched.plugins.tensorflow import DistributedOptimizer

    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    config = soak_config(args)
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(8)])
        opt = DistributedOptimizer(keras.optimizers.Adam(1e-3), config=config)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    step_fn = tf.function(lambda x, y: strategy.run(train_step, args=(x, y)))
    rs = np.random.RandomState(rank)
    samples = []
    with opt:
        for step in range(args.steps):
            x, y = rs.randn(16, 32).astype("float32"), rs.randn(16, 8).astype("float32")
            step_fn(x, y)
            if step % args.every == 0 or step == args.steps - 1:
                samples.append(dict(step=step, **sample()))
        # the step is one compiled graph: its pieces are those of the traced plan, every step
        per_step = len(opt.commsched.plans[-1].pieces) if opt.commsched.plans else 0
    write_result(args.out, rank, {"samples": samples, "pieces": per_step * args.steps, "after_close": sample()})
    sys.stdout.flush()
    sys.stderr.flush()
    # MultiWorkerMirroredStrategy's shutdown at interpreter exit can wait on the other
    # worker's coordination service; the result is written, so leave now
    os._exit(0)


def worker_mxnet(args: argparse.Namespace) -> None:
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    import commsched.plugins.mxnet as cmx

    config = soak_config(args)
    kv = cmx.KVStore(mx.kv.create("dist_sync"), config)
    rank = kv.rank
    server = getattr(kv, "_store_server", None)  # worker 0 serves the order store
    # keys judged constant; the queued decisions apart (a backlog at a sample is timing, as for torch)
    store_keys = server.data_keys if server is not None else None
    queued = server.queued_values if server is not None else None
    mx.random.seed(3)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(64, in_units=32, activation="relu"), gluon.nn.Dense(64, in_units=64, activation="tanh"),
            gluon.nn.Dense(8, in_units=64))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, kvstore=kv)
    rs = np.random.RandomState(rank)
    samples = []
    for step in range(args.steps):
        x, y = mx.nd.array(rs.randn(16, 32)), mx.nd.array(rs.randn(16, 8))
        with autograd.record():
            loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        trainer.step(16)
        loss.asnumpy()
        if step % args.every == 0 or step == args.steps - 1:
            samples.append(dict(step=step, **sample(store_keys, queued)))
    kv.synchronize()
    pieces = kv.stats()["pieces"]
    kv.close()
    write_result(args.out, rank, {"samples": samples, "pieces": pieces, "after_close": sample()})


def worker(args: argparse.Namespace) -> None:
    if args.worker == "tensorflow":
        worker_tensorflow(args)
    elif args.worker == "mxnet":
        worker_mxnet(args)
    else:
        worker_torch(args)


def judge(rank_result: dict, warmup: int) -> dict:
    """The figures and the verdict of one worker."""
    after = [s for s in rank_result["samples"] if s["step"] >= warmup]
    base, last = after[0], after[-1]
    growth = (last["rss_bytes"] - base["rss_bytes"]) / base["rss_bytes"]
    threads = sorted({s["threads"] for s in after})
    own = sorted({s["threads"] - s.get("pool_threads", 0) for s in after})  # all but the frameworks' pools
    pools = sorted({s.get("pool_threads", 0) for s in after})
    keys = sorted({s["store_keys"] for s in after if s["store_keys"] is not None})
    queued = [s["queued"] for s in after if s.get("queued") is not None]
    why = []
    if growth >= RSS_GROWTH_LIMIT:
        why.append(f"RSS grew {growth:.1%} (limit {RSS_GROWTH_LIMIT:.0%})")
    if len(own) != 1:
        why.append(f"thread count (without {', '.join(FRAMEWORK_POOLS)} pool threads) changed: {own}")
    if len(pools) > 1 and max(pools) > POOL_LIMIT:
        why.append(f"framework pool threads grew past {POOL_LIMIT}: {pools}")
    if len(keys) > 1:
        why.append(f"store keys changed: {keys}")
    return {"rank": rank_result["rank"], "rss_base_mib": round(base["rss_bytes"] / 2**20, 2),
            "rss_end_mib": round(last["rss_bytes"] / 2**20, 2), "rss_growth": round(growth, 4),
            "rss_max_mib": round(max(s["rss_bytes"] for s in after) / 2**20, 2), "threads": threads,
            "pool_threads": pools, "store_keys": keys, "queued_max": max(queued) if queued else None,
            "queued_last": queued[-1] if queued else None, "pieces": rank_result["pieces"], "ok": not why, "why": why}


def start(backend: str, me: list[str], env: dict, workdir: Path, timeout: float) -> tuple[list, list]:
    """Start the job's processes (2 workers; MXNet: its launcher); return them and cleanup callables."""
    from commsched.bench.procs import free_ports

    logs, cleanup = [], []

    def popen(argv, extra, name):
        log = open(workdir / f"{backend}.{name}.log", "wb")
        logs.append(log)
        return subprocess.Popen(argv, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(REPO), start_new_session=True)

    cleanup.append(lambda: [log.close() for log in logs])
    if backend == "torch":
        port = free_ports(1)[0]
        procs = [popen(me, dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2"),
                       f"rank{r}") for r in range(2)]
    elif backend == "horovod":
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer

        server = RendezvousServer()
        port = server.start()
        server.init(get_host_assignments(parse_hosts("localhost:2"), 2))
        cleanup.append(server.stop)
        procs = [popen(me, dict(HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                                HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="lo",
                                HOROVOD_HOSTNAME="localhost", HOROVOD_RANK=str(r), HOROVOD_SIZE="2",
                                HOROVOD_LOCAL_RANK=str(r), HOROVOD_LOCAL_SIZE="2", HOROVOD_CROSS_RANK="0",
                                HOROVOD_CROSS_SIZE="1"), f"rank{r}") for r in range(2)]
    elif backend == "tensorflow":
        cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
        procs = [popen(me, dict(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": r}})),
                       f"rank{r}") for r in range(2)]
    else:  # mxnet: the launcher starts the scheduler, the server and both workers, and stops them
        cmd = [sys.executable, "-m", "commsched", "launch", "mxnet", "--workers", "2", "--servers", "1",
               "--timeout", str(timeout), "--", *me]
        procs = [popen(cmd, {}, "launcher")]
    return procs, cleanup


def run_backend(backend: str, steps: int, every: int, warmup: int, ordering: str, workdir: Path,
                timeout: float, timeout_s: float = 60.0) -> dict:
    outdir = workdir / backend
    outdir.mkdir(parents=True, exist_ok=True)
    for stale in outdir.glob("rank*.json"):
        stale.unlink()
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", backend, "--steps", str(steps),
          "--every", str(every), "--ordering", ordering, "--timeout-s", str(timeout_s), "--out", str(outdir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               CUDA_VISIBLE_DEVICES="")
    started = time.monotonic()
    procs, cleanup = start(backend, me, env, workdir, timeout)
    try:
        for p in procs:
            p.wait(timeout=max(1.0, timeout + 30 - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # the process's own session: only what this run started
                p.wait(timeout=10)
        for fn in reversed(cleanup):
            fn()
    seconds = time.monotonic() - started
    outs = [outdir / f"rank{r}.json" for r in range(2)]
    codes = [p.returncode for p in procs]
    if not all(o.exists() for o in outs):
        return {"ok": False, "why": [f"a worker wrote no result (exit {codes}); logs in {workdir}"],
                "seconds": round(seconds, 1), "store_keys_measure": STORE_KEYS[backend]}
    ranks = [judge(json.loads(o.read_text()), warmup) for o in outs]
    why = [f"exit status {codes} (a process failed or was killed at the deadline)"] if any(codes) else []
    return {"ok": all(r["ok"] for r in ranks) and not why, "why": why, "steps": steps, "ordering": ordering,
            "warmup": warmup, "seconds": round(seconds, 1), "store_keys_measure": STORE_KEYS[backend],
            "ranks": ranks, "returncodes": codes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {', '.join(BACKENDS)}")
    ap.add_argument("--steps", type=int, default=2000, help="steps per run (default 2000)")
    ap.add_argument("--every", type=int, default=50, help="sample every this many steps (default 50)")
    ap.add_argument("--warmup", type=int, default=None, help="baseline step (default: a tenth of --steps)")
    ap.add_argument("--ordering", default="dynamic", choices=["dynamic", "static", "fifo"])
    ap.add_argument("--timeout-s", type=float, default=60.0, help="the scheduler's timeout_s (default 60)")
    ap.add_argument("--out", default="soak.json")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)  # --out is the folder for this worker's rank<r>.json
        return 0
    if args.steps < 2 or args.every < 1:
        ap.error("--steps must be at least 2 and --every at least 1")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        ap.error(f"--backends: unknown {', '.join(bad) or '(none given)'}; use some of {', '.join(BACKENDS)}")
    warmup = args.warmup if args.warmup is not None else max(args.every, args.steps // 10)
    if warmup >= args.steps:
        ap.error(f"--warmup {warmup} must be below --steps {args.steps}")
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="commsched-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    startup = {"torch": 60, "horovod": 60, "tensorflow": 120, "mxnet": 120}
    report = {b: run_backend(b, args.steps, args.every, warmup, args.ordering, workdir,
                             timeout=startup[b] + args.steps * 0.5, timeout_s=args.timeout_s) for b in backends}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
