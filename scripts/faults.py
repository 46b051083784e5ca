#!/usr/bin/env python3
"""The kill matrix: SIGKILL one rank of a 2-rank job at a seeded point and check the survivor.

For each backend (``torch`` = torch/gloo, ``horovod`` = torch on Horovod over gloo,
``tensorflow`` = TF collective ops under MultiWorkerMirroredStrategy, ``mxnet`` =
the commsched KVStore on ps-lite ``dist_sync``) and each seed, one job of two ranks
trains a small model; the victim rank (seeded) SIGKILLs itself at a seeded step and
phase:

* ``backward``: inside backward, right after a seeded gradient was handed to commsched
  (torch, Horovod: a post-accumulate-grad hook; MXNet: ``loss.backward()`` returned,
  the engine is still running it);
* ``in_flight``: right after ``step()`` returned, with pieces in flight;
* ``forward_wait``: at the start of the next forward, where it waits for its pieces;
* ``switch`` (torch, Horovod): during an agreed plan/tuning switch of ``ordering="planned"``
  without a plan file or ``ordering="auto"``: as rank 0 decides, as every rank takes the
  decision one step later, or between the old scheduler and the new one (``SWITCH_POINTS``);
* ``timer`` (TensorFlow, whose step is one compiled graph): a thread kills the
  process a seeded fraction of a step time into a step.

A kill is *clean* when the survivor raised a ``CommschedError`` (TensorFlow: see
below) naming the cause within ``timeout_s + 5`` s of the kill, every process of the
job exited by itself (none had to be killed), the survivor's commsched threads were
all gone after ``close()`` (jobs run on loopback and create no network namespace,
so none can be left), and the store the survivor could still read (torch, when rank 0
survives) holds no key commsched wrote but the abort notice, the close count, a switch
decision the dead rank never read and the dead rank's own rendezvous key of commsched's
group (``ALLOWED_LEFT``; the record lists them).

TensorFlow's step is the user's compiled function: a dead peer surfaces as TF's own
``UnavailableError``/``DeadlineExceededError`` from that call, not a
``CommschedError``; for it "clean" requires a TF error that names the commsched piece
(``commsched_...``), and the summary says so (``error_kind``).

Usage::

    python scripts/faults.py --kills 20 --out faults.json          # the full matrix
    python scripts/faults.py --backends torch --kills 3 --seed 7   # a sample

The JSON summary: per backend, kills tried and clean, the phases hit, the slowest
survivor error after the kill, and every unclean kill with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from commsched.bench.procs import free_ports, pids_with_env

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("torch", "horovod", "tensorflow", "mxnet")
PHASES = {"torch": ("backward", "in_flight", "forward_wait", "switch"),
          "horovod": ("backward", "in_flight", "forward_wait", "switch"),
          "mxnet": ("backward", "in_flight", "forward_wait"),
          "tensorflow": ("timer",)}
STEPS = 12          # steps each rank runs when nobody dies
FIRST_KILL_STEP = 2  # the kill comes after warm-up (the static plan, TF's traces)
SLACK_S = 5.0       # what the issue allows beyond timeout_s
# phase "switch" (torch, Horovod): the job runs ordering="planned" without a plan file or
# ordering="auto", which decide new settings at the end of step SWITCH_DECISION_STEP (rank 0),
# take the decision one step later on every rank and switch (a new scheduler; planned: the new
# plan's agreement), so step +2 runs it (plugins/torch/optimizer.py, ADAPT_RECORD_STEPS - 1).
# The victim dies at one point of that switch:
#   decide  - at the end of the decision step, before rank 0 decides and publishes;
#   take    - as it takes the decision, one step later (rank 0: before a Horovod broadcast);
#   rebuild - in the switch itself: the old scheduler drained and closed, the new one not started.
SWITCH_ORDERINGS = ("planned", "auto")
SWITCH_POINTS = ("decide", "take", "rebuild")
SWITCH_DECISION_STEP = 3
# What a survivor's store may still hold of commsched's after a rank died (a job whose ranks
# all close leaves nothing): the abort notice and the close count of core/protocol.Channel.close
# (the dead rank never counts), a switch decision the dead follower never read, and the dead
# rank's own rendezvous key of commsched's group (each rank deletes its own at close).
ALLOWED_LEFT = ("/abort", "/closed", "/switch/")


# --------------------------------------------------------------------------- plan


def plan_for(backend: str, seed: int) -> dict:
    """Where seed ``seed`` kills: victim rank, step, phase, and the phase's detail."""
    rng = random.Random(f"{backend}:{seed}")
    plan = {"seed": seed, "victim": rng.randrange(2), "step": rng.randint(FIRST_KILL_STEP, STEPS - 4),
            "phase": rng.choice(PHASES[backend]), "param": rng.randrange(6), "fraction": rng.random()}
    if plan["phase"] == "switch":
        plan["ordering"] = SWITCH_ORDERINGS[plan["param"] % len(SWITCH_ORDERINGS)]
        plan["switch_point"] = SWITCH_POINTS[min(int(plan["fraction"] * len(SWITCH_POINTS)), len(SWITCH_POINTS) - 1)]
        plan["step"] = SWITCH_DECISION_STEP + (plan["switch_point"] != "decide")
    return plan


# --------------------------------------------------------------------------- worker side


class Worker:
    """What one rank of a fault job does: train, kill itself if it is the victim, report."""

    def __init__(self, out: Path, plan: dict, rank: int, timeout_s: float) -> None:
        self.out, self.plan, self.rank, self.timeout_s = out, plan, rank, timeout_s
        self.victim = rank == plan["victim"]
        self.step = -1
        self.phase = "start"

    def die_if(self, phase: str) -> None:
        if self.victim and self.step == self.plan["step"] and self.plan["phase"] == phase:
            self.die()

    def die(self) -> None:
        sig = self.plan.get("signal", "KILL")
        record = {"time": time.time(), "rank": self.rank, "step": self.step, "phase": self.plan["phase"],
                  "in": self.phase, "signal": sig}
        write(self.out / "killed.json", record)
        os.kill(os.getpid(), getattr(signal, "SIG" + sig))
        if sig == "INT":  # Python runs the handler (KeyboardInterrupt) at the next bytecode
            time.sleep(0)

    def arm_timer(self, step_s: float) -> None:
        """TensorFlow: kill a seeded fraction of a step into the victim's kill step."""
        if not self.victim:
            return

        def fire() -> None:
            time.sleep(self.plan["fraction"] * step_s)
            self.die()
        threading.Thread(target=fire, name="faults-timer", daemon=True).start()

    def report(self, exc: BaseException | None, **extra) -> None:
        import commsched

        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("commsched"))
        write(self.out / f"rank{self.rank}.json", {
            "rank": self.rank, "time": time.time(), "step": self.step, "phase": self.phase,
            "error_type": None if exc is None else type(exc).__name__,
            "error": None if exc is None else str(exc)[:2000],
            "is_commsched": isinstance(exc, commsched.CommschedError), "threads_after_close": threads, **extra})


def write(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def torch_model():
    import torch
    import torch.nn as nn

    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def worker_torch(w: Worker, engine: str) -> None:
    import torch

    import commsched
    from commsched.plugins.torch import DistributedOptimizer

    torch.set_num_threads(1)
    store_keys = None
    if engine == "horovod":
        import horovod.torch as hvd

        hvd.init()
        w.rank = hvd.rank()
        w.victim = w.rank == w.plan["victim"]
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        w.rank = dist.get_rank()
        w.victim = w.rank == w.plan["victim"]
        store = dist.distributed_c10d._get_default_store()
        store_keys = store.list_keys
    model = torch_model()
    config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, timeout_s=w.timeout_s,
                                       ordering=w.plan.get("ordering", "dynamic"))
    keys_before = store_keys() if store_keys else None
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                               backend=engine, config=config)
    if w.plan["phase"] == "switch" and w.victim:
        arm_switch_kill(w, opt)
    params = list(model.parameters())
    # registered after commsched's own hook, so the gradient is already submitted when this runs
    params[w.plan["param"] % len(params)].register_post_accumulate_grad_hook(lambda p: w.die_if("backward"))
    model.register_forward_pre_hook(lambda m, a: w.die_if("forward_wait"), prepend=True)
    error = None
    try:
        for step in range(STEPS):
            w.step = step
            g = torch.Generator().manual_seed(100 * step + w.rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            w.phase = "forward"
            loss = ((model(x) - y) ** 2).mean()
            w.phase = "backward"
            loss.backward()
            w.phase = "step"
            opt.step()
            w.die_if("in_flight")
        w.phase = "synchronize"
        opt.synchronize()
    except Exception as exc:  # the survivor's error, which the driver judges
        error = exc
    finally:
        with contextlib.suppress(Exception):
            opt.close()
    keys_after = None
    if store_keys and w.rank == 0:
        with contextlib.suppress(Exception):
            keys_after = sorted(store_keys())
    w.report(error, keys_before=sorted(keys_before) if keys_before is not None else None, keys_after=keys_after)


def arm_switch_kill(w: Worker, opt) -> None:
    """Phase ``switch``: make the victim die at ``w.plan["switch_point"]`` of the first agreed switch
    (see SWITCH_POINTS), by wrapping the optimizer's own switch steps on this instance."""
    if opt._next_decision != SWITCH_DECISION_STEP:
        raise RuntimeError(f"the first decision step is {opt._next_decision}, faults.py expects "
                           f"{SWITCH_DECISION_STEP}: update SWITCH_DECISION_STEP")
    point = w.plan["switch_point"]
    if point == "decide":
        at_boundary = opt._at_boundary

        def decide(ended: int) -> None:
            if ended == SWITCH_DECISION_STEP:
                w.phase = "switch:decide"
                w.die()
            at_boundary(ended)
        opt._at_boundary = decide
    elif point == "take":
        take = opt._switch.take

        def take_then_die(step: int):
            w.phase = "switch:take"
            w.die()
            return take(step)
        opt._switch.take = take_then_die
    else:
        rebuild = opt._rebuild

        def rebuild_and_die(*args, **kwargs):
            old = opt._scheduler
            close = old.close

            def close_then_die(*a, **k):
                close(*a, **k)
                w.phase = "switch:rebuild"
                w.die()
            old.close = close_then_die
            return rebuild(*args, **kwargs)
        opt._rebuild = rebuild_and_die


def worker_tensorflow(w: Worker) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import commsched
    from commsched.plugins.tensorflow import DistributedOptimizer, function

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, timeout_s=w.timeout_s)
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(4)])
        opt = DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), config=config)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    # commsched's tf.function: a lost peer reaches the survivor as a CommschedError (plain tf.function: TF's)
    step_fn = function(lambda x, y: strategy.run(train_step, args=(x, y)))
    rs = np.random.RandomState(w.rank)
    error = None
    step_s = 0.05
    try:
        for step in range(STEPS):
            w.step = step
            x, y = rs.rand(8, 16).astype("float32"), rs.rand(8, 4).astype("float32")
            if step == w.plan["step"]:
                w.arm_timer(step_s)
            w.phase = "step"
            t0 = time.monotonic()
            step_fn(x, y)
            if step >= 1:
                step_s = time.monotonic() - t0
            if step == w.plan["step"] and w.victim:
                time.sleep(step_s)  # the timer fires within this step's time in any case
                w.die()
    except Exception as exc:
        error = exc
    finally:
        with contextlib.suppress(Exception):
            opt.close()
    w.report(error, error_kind="tf_error_naming_piece")


def worker_mxnet(w: Worker) -> None:
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    import commsched
    import commsched.plugins.mxnet as cmx

    inner = mx.kv.create("dist_sync")
    config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, timeout_s=w.timeout_s)
    kv = cmx.KVStore(inner, config)
    w.rank = kv.rank
    w.victim = w.rank == w.plan["victim"]
    mx.random.seed(5)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(64, in_units=16, activation="relu"), gluon.nn.Dense(64, in_units=64, activation="tanh"),
            gluon.nn.Dense(4, in_units=64))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9}, kvstore=kv)
    rs = np.random.RandomState(w.rank)
    error = None
    try:
        for step in range(STEPS):
            w.step = step
            x, y = mx.nd.array(rs.rand(8, 16)), mx.nd.array(rs.rand(8, 4))
            w.die_if("forward_wait")
            w.phase = "forward"
            with autograd.record():
                loss = ((net(x) - y) ** 2).mean()
            w.phase = "backward"
            loss.backward()
            w.die_if("backward")
            w.phase = "step"
            trainer.step(8)
            w.die_if("in_flight")
            loss.asnumpy()
        w.phase = "synchronize"
        for p in net.collect_params().values():
            p.data().wait_to_read()
    except Exception as exc:
        error = exc
    finally:
        with contextlib.suppress(Exception):
            kv.close()
    w.report(error)
    # ps-lite's own shutdown waits for the dead worker in its final barrier; a user's
    # job ends when the launcher stops it. The survivor's report is what is judged.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 1)


def worker_main(args: argparse.Namespace) -> None:
    # a rank still running this long after the kill is hung: its Python stacks go to its log
    # (every thread's, again each period) so an unclean record says where it waits
    faulthandler.dump_traceback_later(args.timeout_s + SLACK_S + 15, repeat=True)
    plan = json.loads(args.plan)
    rank = int(os.environ.get("RANK", os.environ.get("COMMSCHED_FAULT_RANK", "0")))
    w = Worker(Path(args.out), plan, rank, args.timeout_s)
    if args.worker == "tensorflow":
        worker_tensorflow(w)
        sys.stdout.flush()
        os._exit(0)  # MWMS blocks at interpreter exit waiting for the lost peer
    elif args.worker == "mxnet":
        worker_mxnet(w)
    else:
        worker_torch(w, args.worker)


# --------------------------------------------------------------------------- driver side


def tagged_pids(tag: str) -> list[int]:
    """Live processes of the job tagged ``tag``."""
    return pids_with_env("COMMSCHED_FAULT_JOB", tag)


def base_env(tag: str) -> dict:
    env = dict(os.environ)
    env.update(COMMSCHED_FAULT_JOB=tag, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def start_job(backend: str, plan: dict, out: Path, timeout_s: float, tag: str):
    """Start the job's processes; return (processes, a cleanup callable)."""
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", backend, "--plan", json.dumps(plan),
          "--out", str(out), "--timeout-s", str(timeout_s)]
    env = base_env(tag)
    logs = []

    def popen(argv, extra, name):
        log = open(out / f"{name}.log", "wb")
        logs.append(log)
        return subprocess.Popen(argv, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(REPO), start_new_session=True)

    cleanup = [lambda: [log.close() for log in logs]]
    if backend == "torch":
        port = free_ports(1)[0]
        procs = [popen(me, dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                                LOCAL_RANK=str(r)), f"rank{r}") for r in range(2)]
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
                                HOROVOD_CROSS_SIZE="1", RANK=str(r)), f"rank{r}") for r in range(2)]
    elif backend == "tensorflow":
        ports = free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        procs = [popen(me, dict(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": r}}),
                                RANK=str(r)), f"rank{r}") for r in range(2)]
    elif backend == "mxnet":
        grace = timeout_s + SLACK_S + 10
        cmd = [sys.executable, "-m", "commsched", "launch", "mxnet", "--workers", "2", "--servers", "1",
               "--timeout", str(job_deadline(backend, timeout_s)), "--grace", str(grace), "--", *me]
        procs = [popen(cmd, {}, "launcher")]
    else:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    return procs, lambda: [fn() for fn in reversed(cleanup)]


def job_deadline(backend: str, timeout_s: float) -> float:
    """Seconds a whole job may take: start-up (slow imports on shared cores) + the kill + the error."""
    startup = {"torch": 60, "horovod": 60, "tensorflow": 90, "mxnet": 90}[backend]
    return startup + timeout_s + SLACK_S + 30


def run_kill(backend: str, seed: int, workdir: Path, timeout_s: float, sig: str = "KILL") -> dict:
    """One seeded kill (``sig="INT"``: a Ctrl-C instead); returns its record with ``clean`` and, if not, ``why``."""
    plan = dict(plan_for(backend, seed), signal=sig)
    out = workdir / f"{backend}-{seed}-{sig}"
    out.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    procs, cleanup = start_job(backend, plan, out, timeout_s, tag)
    deadline = time.monotonic() + job_deadline(backend, timeout_s)
    hung = False
    exited_at: list[float | None] = [None] * len(procs)
    try:
        while time.monotonic() < deadline and None in exited_at:
            for i, proc in enumerate(procs):
                if exited_at[i] is None and proc.poll() is not None:
                    exited_at[i] = time.time()
            time.sleep(0.05)
        hung = None in exited_at
        # the launcher (MXNet) may be gone while its children still exit
        settle = time.monotonic() + 10
        while tagged_pids(tag) and time.monotonic() < settle:
            time.sleep(0.2)
        stray = tagged_pids(tag)
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in tagged_pids(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        cleanup()
    record = {"backend": backend, **plan, "hung": hung, "stray": stray, "returncodes": [p.returncode for p in procs]}
    why = []
    killed = _read(out / "killed.json")
    survivor = 1 - plan["victim"]
    result = _read(out / f"rank{survivor}.json")
    record["killed"] = killed
    record["survivor"] = result
    if killed and len(procs) == 2 and exited_at[plan["victim"]] is not None:
        record["victim_exit_after_signal_s"] = round(exited_at[plan["victim"]] - killed["time"], 3)
        if sig == "INT" and record["victim_exit_after_signal_s"] > timeout_s + SLACK_S:
            why.append(f"the interrupted rank took {record['victim_exit_after_signal_s']:.1f} s to exit")
    if killed is None:
        why.append("the victim never reached its kill point")
    if result is None:
        why.append("the survivor wrote no report (crashed or hung)")
    if killed and result:
        record["error_after_kill_s"] = round(result["time"] - killed["time"], 3)
        if result["error_type"] is None:
            why.append("the survivor finished without an error")
        elif not result["is_commsched"]:
            why.append(f"not a CommschedError: {result['error_type']}")
        if record["error_after_kill_s"] > timeout_s + SLACK_S:
            why.append(f"error {record['error_after_kill_s']:.1f} s after the kill (> timeout_s + {SLACK_S:g})")
        if result["threads_after_close"]:
            why.append(f"threads left after close: {result['threads_after_close']}")
        if result.get("keys_after") is not None:
            left = sorted(set(result["keys_after"]) - set(result["keys_before"]))
            record["store_keys_left"] = left
            # each rank deletes its own rendezvous key of commsched's group at close: the dead one could not
            dead_rank_key = re.compile(rf"^\d+/.*/{plan['victim']}$")
            unexpected = [k for k in left if not any(a in k for a in ALLOWED_LEFT) and not dead_rank_key.match(k)]
            if unexpected:
                why.append(f"store keys left: {unexpected} (beyond the abort notice, the close count, an unread "
                           "switch decision and the dead rank's own rendezvous key)")
    if hung:
        why.append("a process did not exit within the job deadline")
    if stray:
        why.append(f"processes left running: {stray}")
    record["clean"] = not why
    record["why"] = why
    return record


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarize(records: list[dict]) -> dict:
    summary: dict = {}
    for backend in sorted({r["backend"] for r in records}):
        mine = [r for r in records if r["backend"] == backend]
        delays = [r["error_after_kill_s"] for r in mine if "error_after_kill_s" in r]
        summary[backend] = {
            "tried": len(mine), "clean": sum(r["clean"] for r in mine),
            "phases": {p: sum(r["phase"] == p for r in mine) for p in PHASES[backend]},
            "switch_points": {f"{o}:{p}": n for o in SWITCH_ORDERINGS for p in SWITCH_POINTS
                              if (n := sum(r.get("ordering") == o and r.get("switch_point") == p for r in mine))},
            "error_types": sorted({(r["survivor"] or {}).get("error_type") or "none" for r in mine}),
            "max_error_after_kill_s": max(delays) if delays else None,
            # keys commsched left in a store the survivor could read (torch with rank 0 surviving; None: none read)
            "max_store_keys_left": max((len(r["store_keys_left"]) for r in mine if "store_keys_left" in r),
                                       default=None),
            "unclean": [{"seed": r["seed"], "phase": r["phase"], "step": r["step"], "victim": r["victim"],
                         "why": r["why"]} for r in mine if not r["clean"]],
        }
    return summary


def run_matrix(backends, kills: int, seed: int, timeout_s: float, workdir: Path, log=print) -> dict:
    records = []
    for backend in backends:
        for s in range(seed, seed + kills):
            record = run_kill(backend, s, workdir, timeout_s)
            records.append(record)
            log(f"{backend} seed={s} victim={record['victim']} step={record['step']} phase={record['phase']}: "
                f"{'clean' if record['clean'] else 'UNCLEAN ' + '; '.join(record['why'])}"
                f" (error {record.get('error_after_kill_s')} s after the kill)")
    return {"timeout_s": timeout_s, "slack_s": SLACK_S, "seed": seed, "summary": summarize(records),
            "kills": records}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {', '.join(BACKENDS)}")
    ap.add_argument("--kills", type=int, default=20, help="seeded kills per backend (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="the scheduler's timeout_s (default 5)")
    ap.add_argument("--out", default="faults.json", help="JSON summary path (default faults.json)")
    ap.add_argument("--workdir", default=None, help="where job logs go (default: a new temporary folder)")
    ap.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return 0
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        ap.error(f"--backends: unknown {', '.join(unknown)}; use some of {', '.join(BACKENDS)}")
    if args.kills < 1:
        ap.error("--kills must be at least 1")
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="commsched-faults-"))
    report = run_matrix(backends, args.kills, args.seed, args.timeout_s, workdir)
    report["workdir"] = str(workdir)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    return 0 if all(v["clean"] == v["tried"] for v in report["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
