"""One benchmark worker process (one rank): ``python -m ... .worker --spec S --rank R``.

The runner starts one per rank, inside the rank's node namespace, with
``GLOO_SOCKET_IFNAME``/``MASTER_ADDR``/``MASTER_PORT`` set. The spec file says
what to do:

- ``mode="baseline"``: the reference numbers of a run, without any strategy:
  compute (forward, backward, optimizer) on all ranks at once and on rank 0
  alone, one flat all-reduce of all gradient bytes, and compute while such an
  all-reduce is in flight (the CPU-contention cap); rank 0 also profiles
  the layers.
- ``mode="calibrate"``: a few compute steps and all-reduces at the spec's batch
  size (``--calibrate`` picks the batch size from two of these).
- ``mode="train"``: ``warmup`` then ``steps`` training steps of one strategy, with
  the per-step breakdown's timers (:class:`StepTimers`).
- ``mode="interleave"``: several strategies in this one process, each on its own copy of
  the model, alternating in blocks of ``steps`` measured steps (:func:`run_interleave`).

Results go to ``<run_dir>/rank<R>.json`` (written atomically), rank 0's
progress to ``<run_dir>/progress``. A worker dies with its parent
(``PR_SET_PDEATHSIG``), every collective has a timeout, and the process group
is destroyed before exit (gloo may abort at exit otherwise).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from commsched.bench.cpu import CpuWindow
from commsched.bench.report import coverage, median
from commsched.timeline import rank_path
from commsched.plugins.torch.bench.strategies import (
    StrategyUnavailable,
    make_strategy,
    parse_strategies,
)
from commsched.plugins.torch.bench.workloads import get_workload, param_bytes, profile_layers


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the runner dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # parent already gone before prctl took effect
        os._exit(1)


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class Progress:
    """Rank 0 tells the runner how far it is; other ranks stay silent."""

    def __init__(self, run_dir: str, enabled: bool) -> None:
        self.path = os.path.join(run_dir, "progress")
        self.enabled = enabled

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.enabled:
            _write_json(self.path, {"phase": phase, "done": done, "total": total})


def _checksum(model: torch.nn.Module) -> str:
    """Exact fingerprint of all parameters: ranks of a correct run agree bitwise."""
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            total += p.double().sum() * (i + 1)
    return struct.pack(">d", float(total)).hex()


def _barrier() -> None:
    dist.barrier()


def _setup(spec: dict, rank: int) -> tuple[Any, torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # denormals would make CPU timings erratic
    dist.init_process_group(
        "gloo", rank=rank, world_size=spec["world_size"],
        timeout=datetime.timedelta(seconds=spec["collective_timeout_s"]),
    )
    workload = get_workload(spec["workload"])
    torch.manual_seed(spec["seed"])  # same initial weights on every rank
    model = workload.build()
    gen = torch.Generator().manual_seed(spec["seed"] + 1 + rank)  # own data per rank
    x, y = workload.make_batch(spec["batch_size"], gen)
    return workload, model, x, y


def _opt_factory(workload: Any) -> Callable:
    return lambda params: torch.optim.SGD(params, lr=workload.lr, momentum=0.9)


def run_baseline(spec: dict, rank: int, progress: Progress) -> dict:
    """Compute alone, comm alone, compute under comm; see the module docstring."""
    workload, model, x, y = _setup(spec, rank)
    opt = _opt_factory(workload)(model.parameters())
    reps, warmup = spec["baseline_steps"], max(1, spec["warmup"])
    total = 4 * reps + warmup
    done = 0
    result: dict[str, Any] = {"param_bytes": param_bytes(model),
                              "num_params": sum(p.numel() for p in model.parameters())}

    def step(times: list | None) -> None:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = workload.loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if times is not None:
            times.append((t1 - t0, t2 - t1, t3 - t2))

    if rank == 0:
        result["layers"] = profile_layers(model, x, y, workload.loss)
    _barrier()
    for _ in range(warmup):
        step(None)
        done += 1
        progress("baseline", done, total)

    phases: dict[str, list] = {"all": [], "one": [], "under_comm": []}
    for _ in range(reps):  # every rank computes at once, as in a real step
        _barrier()
        step(phases["all"])
        done += 1
        progress("baseline", done, total)
    for _ in range(reps):  # rank 0 alone, the others wait at the barrier
        _barrier()
        if rank == 0:
            step(phases["one"])
        done += 1
        progress("baseline", done, total)

    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    comm = []
    window = CpuWindow()
    for _ in range(reps):
        _barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        comm.append(time.perf_counter() - t0)
        done += 1
        progress("baseline", done, total)
    result["comm_cpu"] = window.stop()

    under = []
    for _ in range(reps):
        _barrier()
        landed = _Stamp()
        t0 = time.perf_counter()
        work = dist.all_reduce(flat, async_op=True)
        # Its own end, stamped by the engine's thread as it completes: work.wait() after the step would
        # only see an all-reduce that ended before the compute did end with it (comm_contention >> 1).
        work.get_future().add_done_callback(landed)
        step(phases["under_comm"])
        t1 = time.perf_counter()
        work.wait()
        under.append((t1 - t0, landed.at(timeout=1.0) - t0))
        done += 1
        progress("baseline", done, total)
    result["stream"] = _stream_phase(spec, step, flat, phases["all"], comm, under, reps)
    _barrier()
    result.update({
        "forward_s": [t[0] for t in phases["all"]],
        "backward_s": [t[1] for t in phases["all"]],
        "optimizer_s": [t[2] for t in phases["all"]],
        "one_worker_s": [sum(t) for t in phases["one"]],
        "comm_s": comm,
        "forward_under_comm_s": [t[0] for t in phases["under_comm"]],
        "backward_under_comm_s": [t[1] for t in phases["under_comm"]],
        "optimizer_under_comm_s": [t[2] for t in phases["under_comm"]],
        # compute ended / all-reduce ended, from the all-reduce's start
        "under_comm_span_s": under,
    })
    return result


#: The stream of all-reduces under which :func:`_stream_phase` computes lasts this many times the compute.
STREAM_COVER = 1.25
#: At most this many all-reduces in one stream (a step far longer than one all-reduce of its bytes).
STREAM_MAX = 64
#: The stream phase runs only where the one all-reduce beside a step covered less than this share of it.
STREAM_NEEDED_BELOW = 0.99


def _stream_phase(spec: dict, step: Callable, flat: torch.Tensor, alone: list, comm: list, under: list,
                  reps: int) -> dict[str, Any]:
    """Compute under communication that outlasts it, each such step beside one alone (``contention``).

    The phase before times compute beside one all-reduce of every gradient byte, which ends first
    where the compute is longer (compute-heavy: it covered a quarter of the step); the share of the
    step it slowed is then a few per cent of the compute, inside this machine's noise, and the
    correction for the part it did not cover multiplies that noise by four (measured on compute-heavy:
    contention 1.17 and 1.95 from two baselines of the same flags, minutes apart). Here a thread runs
    ``count`` such all-reduces one after another while the step computes, so the whole compute runs
    beside communication, and each such step follows one alone behind the same barrier, so a drift of
    the machine's speed between them cancels. ``count`` (``ceil(STREAM_COVER x compute / all-reduce)``)
    is rank 0's, broadcast so every rank issues as many collectives; where the phase before's all-reduce
    lasted the whole compute (rank 0's coverage at least :data:`STREAM_NEEDED_BELOW`), its ratio is the
    slowdown itself and the phase is skipped (``count`` 0).
    """
    compute = median([sum(t) for t in alone]) or 0.0
    allreduce = median(comm) or 0.0
    cover = coverage(under)
    wanted = math.ceil(STREAM_COVER * compute / max(allreduce, 1e-6))
    needed = cover < STREAM_NEEDED_BELOW and dist.get_world_size() > 1  # one rank: nothing on a network
    agreed = torch.tensor([min(STREAM_MAX, max(1, wanted)) if needed else 0])
    dist.broadcast(agreed, src=0)
    count = int(agreed.item())
    if count == 0:
        return {"count": 0, "alone_s": [], "under_s": [], "span_s": []}
    timeout = spec["collective_timeout_s"]
    alone_steps: list = []
    under_steps: list = []
    spans = []
    for _ in range(reps):
        _barrier()
        step(alone_steps)
        _barrier()
        stream = _Stream(flat, count)
        t0 = time.perf_counter()
        stream.start()
        step(under_steps)
        t1 = time.perf_counter()
        ended = stream.join(timeout * count)  # each all-reduce has the process group's timeout too
        spans.append((t1 - t0, ended - t0))  # compute ended / the stream ended, from its start
    return {"count": count, "alone_s": [list(t) for t in alone_steps], "under_s": [list(t) for t in under_steps],
            "span_s": spans}


class _Stream:
    """``count`` all-reduces of ``flat``, one after another, on a thread of their own."""

    def __init__(self, flat: torch.Tensor, count: int) -> None:
        self._flat, self._count = flat, count
        self._failed: list[BaseException] = []
        self._ended = 0.0
        self._thread = threading.Thread(target=self._run, name="bench-stream", daemon=True)

    def _run(self) -> None:
        try:
            for _ in range(self._count):
                dist.all_reduce(self._flat)
            self._ended = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread by join()
            self._failed.append(exc)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> float:
        """When the last all-reduce ended (``time.perf_counter()``); its error, or a timeout, raised."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the baseline's stream of {self._count} all-reduces did not end within "
                               f"{timeout} s (collective_timeout_s)")
        if self._failed:
            raise self._failed[0]
        return self._ended


class StepTimers:
    """What the worker measures around one strategy's steps, besides the step times.

    - optimizer apply: every ``torch.optim`` ``step()`` call, timed by torch's global
      optimizer step hooks (``register_optimizer_step_pre_hook``/``post_hook``), counting
      only the innermost call (Horovod's ``step()`` wraps the plain one, which is the
      apply) and not the strategy's own wrapper (commsched's ``DistributedOptimizer.step``
      applies nothing under cross-iteration: its per-parameter updates are the calls
      counted, in the next forward); summed per step by the phase it ran in;
    - the time the user's thread spent in ``Scheduler.submit`` (commsched: the gradient
      hooks call it during backward), by wrapping that one bound method of this run's
      scheduler object;
    - the CPU time of commsched's own threads (``commsched-*``: dispatch, complete,
      publish/order, ...), from ``/proc/self/task/<tid>/schedstat`` (ns; ``stat`` ticks
      where schedstat is missing), over the measured steps.
    """

    def __init__(self, strat: Any, excluded: Any) -> None:
        self.phase = "other"
        #: False while another strategy of an interleaved phase runs: torch's step hooks are global, and
        #: its optimizer calls are not this one's
        self.active = True
        self.apply: dict[str, float] = {}
        self.submit_s = 0.0
        self._excluded = excluded
        self._stack: list[list] = []
        pre = register_optimizer_step_pre_hook(self._pre)
        post = register_optimizer_step_post_hook(self._post)
        self._handles = [pre, post]
        self.scheduler: Any = None
        self.watch(getattr(getattr(strat, "optimizer", None), "_scheduler", None))

    def watch(self, scheduler: Any) -> None:
        """Time ``scheduler.submit`` from now on, and no longer the one timed before (``auto``
        replaces its scheduler at every switch: the bench calls this once the tuner settled)."""
        if scheduler is self.scheduler:
            return
        if self.scheduler is not None:
            self.scheduler.__dict__.pop("submit", None)
        self.scheduler = scheduler
        if scheduler is None:
            return
        real = scheduler.submit

        def timed_submit(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.submit_s += time.perf_counter() - t0

        scheduler.submit = timed_submit  # this object only; removed by close() or the next watch()

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        if self._stack:
            self._stack[-1][1] = True  # the outer call wraps this one
        self._stack.append([time.perf_counter(), False, optimizer is self._excluded])

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active or not self._stack:
            return
        t0, wraps, excluded = self._stack.pop()
        if not wraps and not excluded:
            self.apply[self.phase] = self.apply.get(self.phase, 0.0) + time.perf_counter() - t0

    def take(self) -> tuple[dict[str, float], float]:
        """This step's apply seconds per phase and submit seconds; resets both."""
        apply, submit = self.apply, self.submit_s
        self.apply, self.submit_s = {}, 0.0
        return apply, submit

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.scheduler is not None:
            self.scheduler.__dict__.pop("submit", None)


class _Stamp:
    """A future's done-callback that records when it ran (``time.perf_counter()``)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._t = 0.0

    def __call__(self, _future: Any) -> None:
        self._t = time.perf_counter()
        self._event.set()

    def at(self, timeout: float) -> float:
        """The stamp; now if the callback has not run within ``timeout`` s of the wait that returned."""
        return self._t if self._event.wait(timeout) else time.perf_counter()


def thread_cpu_s() -> dict[tuple[str, int], float]:
    """CPU seconds of each live commsched thread of this process, keyed by (name without the rank,
    thread id) (``commsched-dispatch-r0`` -> ``dispatch``); :func:`thread_cpu_delta` sums by name."""
    import threading

    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        if not t.name.startswith("commsched-") or t.native_id is None:
            continue
        base = f"/proc/self/task/{t.native_id}"
        try:
            with open(f"{base}/schedstat") as f:
                cpu = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            try:
                with open(f"{base}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, ValueError, IndexError):
                continue
        name = t.name[len("commsched-"):].rsplit("-r", 1)[0]
        out[(name, t.native_id)] = cpu
    return out


def thread_cpu_delta(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]) -> dict[str, float]:
    """CPU seconds per thread name between two :func:`thread_cpu_s` samples, thread by thread: a
    thread started in between counts from 0; one that ended in between is not counted (after an
    ``auto`` switch the old scheduler's threads end and new ones of the same names start)."""
    out: dict[str, float] = {}
    for (name, tid), cpu in after.items():
        out[name] = out.get(name, 0.0) + cpu - before.get((name, tid), 0.0)
    return out


def _counters(strat: Any) -> tuple[int | None, dict[str, float] | None, float | None]:
    """Pieces started so far, the scheduler's ``engine_cpu_s`` and its ``callback_cpu_s`` (the piece
    completions run on gloo's threads, which :func:`thread_cpu_s` cannot see) (commsched strategies;
    else None), from one ``stats()`` call."""
    stats = strat.stats()
    if not isinstance(stats, dict):
        return None, None, None
    pieces = stats.get("pieces")
    sched = stats.get("scheduler")
    engine = sched.get("engine_cpu_s") if isinstance(sched, dict) else None
    callback = sched.get("callback_cpu_s") if isinstance(sched, dict) else None
    return ((pieces if isinstance(pieces, int) else None), (dict(engine) if isinstance(engine, dict) else None),
            (float(callback) if isinstance(callback, (int, float)) else None))


def with_callbacks(threads: dict[str, float], before: float | None, after: float | None) -> dict[str, float]:
    """``threads`` (:func:`thread_cpu_delta`) plus ``callback``: the CPU of piece completions on the engine's
    threads between two :func:`_counters` samples (all of ``after`` where the scheduler was replaced in
    between, ``auto``'s switch, and its count started again); unchanged without both samples."""
    if before is None or after is None:
        return threads
    return {**threads, "callback": after - before if after >= before else after}


def run_calibrate(spec: dict, rank: int, progress: Progress) -> dict:
    """A quick look at the regime (``--calibrate``): one warm-up step, then ``CALIBRATE_REPS``
    steps of compute on every rank at once and as many all-reduces of all gradient bytes."""
    workload, model, x, y = _setup(spec, rank)
    opt = _opt_factory(workload)(model.parameters())
    compute, comm = [], []
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    total = 1 + 2 * CALIBRATE_REPS
    for i in range(1 + CALIBRATE_REPS):
        _barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        workload.loss(model(x), y).backward()
        opt.step()
        if i:
            compute.append(time.perf_counter() - t0)
        progress("calibrate", i + 1, total)
    for i in range(CALIBRATE_REPS):
        _barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        comm.append(time.perf_counter() - t0)
        progress("calibrate", 2 + CALIBRATE_REPS + i, total)
    _barrier()
    return {"compute_s": compute, "comm_s": comm, "batch_size": spec["batch_size"]}


#: Timed steps (and all-reduces) of one calibration phase.
CALIBRATE_REPS = 3


#: ``auto``: at most this many warm-up steps beyond ``--warmup`` while the tuner searches (4 recorded
#: steps + 20 samples of 6 steps: docs/tuning.md)
AUTO_MAX_TUNING_STEPS = 124


def tuning(opt: Any) -> bool:
    """Whether ``ordering="auto"`` is still searching, by what every rank knows alike (the agreed
    decisions): while searching, the next decision ends the current sample, at most settle +
    sample steps ahead; a settled tuner's next decision is its drift check, ``check_every`` ahead.
    After the last switch, the kept setting's first ``settle`` steps still warm up: the tuner does not
    score them either (a new scheduler's first step, the reducer's bucket rebuild), and every other
    strategy is measured after its own warm-up steps."""
    from commsched.plugins.torch.optimizer import TUNER_OPTIONS

    stats = opt.stats()
    tuner = stats["tuner"]
    nxt = tuner.get("next_decision")
    if nxt is None:  # a decision taken, to be read next step; else none yet, or no more
        if tuner.get("pending_decision") is not None or not tuner.get("switches"):
            return True
    elif nxt - stats["steps"] <= TUNER_OPTIONS["settle"] + TUNER_OPTIONS["sample_steps"] + 1:
        return True
    changed = [s for s in tuner.get("switches") or () if s.get("settings") is not None or s.get("plan")]
    return bool(changed) and stats["steps"] < changed[-1]["applies_from"] + TUNER_OPTIONS["settle"]


class _Trainer:
    """One strategy on its own model in this worker: its step, its timers, and what its measured steps
    recorded. ``mode="train"`` runs one; ``mode="interleave"`` runs several, in blocks (:func:`run_interleave`).
    Raises :class:`StrategyUnavailable` where the strategy cannot run here."""

    def __init__(self, spec: dict, rank: int, name: str, workload: Any, model: torch.nn.Module,
                 x: torch.Tensor, y: torch.Tensor) -> None:
        (self.sspec,) = parse_strategies(name)
        self.workload, self.model, self.x, self.y = workload, model, x, y
        self.timeline = spec.get("timeline")  # every rank: the follower's trace shows its skew at a step boundary
        self.strat = make_strategy(self.sspec, model, _opt_factory(workload), run_spec=spec,
                                   rank=rank, timeline=self.timeline)
        self.timers = StepTimers(self.strat, self.strat.optimizer if self.sspec.is_commsched else None)
        self.starts: list[float] = []
        self.phases: list[tuple[float, float, float]] = []
        self.applies: list[dict[str, float]] = []
        self.submits: list[float] = []

    def step(self) -> None:
        strat, timers = self.strat, self.timers
        t0 = time.perf_counter()
        timers.phase = "forward"
        strat.zero_grad()
        loss = self.workload.loss(strat.model(self.x), self.y)
        t1 = time.perf_counter()
        timers.phase = "backward"
        loss.backward()
        t2 = time.perf_counter()
        timers.phase = "step"
        strat.step()
        t3 = time.perf_counter()
        timers.phase = "other"
        self.starts.append(t0)
        self.phases.append((t1 - t0, t2 - t1, t3 - t2))
        apply, submit = timers.take()
        self.applies.append(apply)
        self.submits.append(submit)

    def warm_up(self, count: int, progress: Progress) -> None:
        """``count`` unmeasured steps; ``auto`` then steps on while it tunes (its settled choice is measured,
        not its search)."""
        for i in range(count):
            self.step()
            progress("warmup", i + 1, count)
        if self.sspec.kind == "auto":
            extra = 0
            while extra < AUTO_MAX_TUNING_STEPS and tuning(self.strat.optimizer):
                self.step()
                extra += 1
                progress("tuning", extra, AUTO_MAX_TUNING_STEPS)
            self.timers.watch(getattr(self.strat.optimizer, "_scheduler", None))  # the settled one, not the first

    def measure(self, steps: int, progress: Progress, label: str = "steps", steady: bool = False) -> dict:
        """``steps`` measured steps; the result is one rank's of a phase (without ``timeline``). As a phase
        measures them (``steady`` False): after a synchronize and a barrier, the last one ending when all its
        communication has landed. ``steady`` (an interleaved turn, after its lead step): on from the lead step,
        its communication still in flight, and the last one ends where one more step (the trail, not measured)
        starts; then that is drained. So every measured step is a steady one: under cross-iteration a block's
        first step would otherwise wait on nothing and its last overlap nothing, which a short block's median
        does not hide."""
        strat, timers = self.strat, self.timers
        if not steady:
            strat.synchronize()
            _barrier()
        for records in (self.starts, self.phases, self.applies, self.submits):
            records.clear()
        strat.mark_measured()
        pieces0, engine0, callback0 = _counters(strat)
        cpu0 = thread_cpu_s()
        window = CpuWindow()
        for i in range(steps):
            self.step()
            progress(label, i + 1, steps)
        def sample() -> tuple:  # the CPU and the counters, at the end of the measured steps
            return window.stop(), thread_cpu_s(), _counters(strat)

        if steady:
            cpu, cpu1, (pieces1, engine1, callback1) = sample()
            self.step()  # the trail: its start ends the last measured step
            end = self.starts.pop()
            for records in (self.phases, self.applies, self.submits):
                records.pop()
        timers.phase = "synchronize"
        t_sync = time.perf_counter()
        strat.synchronize()
        synced = time.perf_counter()
        sync_apply, _ = timers.take()
        if not steady:
            end = synced
            cpu, cpu1, (pieces1, engine1, callback1) = sample()
        bubbles = strat.bubble_per_step()
        if steady and bubbles:
            bubbles = bubbles[:-1]  # the trail's
        stats = strat.stats()
        checksum = _checksum(self.model)
        _barrier()
        starts, phases, applies = self.starts, self.phases, self.applies
        commsched = self.sspec.is_commsched
        # A step runs from its start to the next one's; the last one ends when all
        # communication has landed (a commsched step() returns before that), or steady, where the trail starts.
        step_times = [b - a for a, b in zip(starts, [*starts[1:], end], strict=True)]
        apply_phases = ("forward", "backward", "step")
        return {
            "step_times_s": step_times,
            "total_s": end - starts[0] if starts else 0.0,
            "forward_s": [p[0] for p in phases],
            "backward_s": [p[1] for p in phases],
            "step_call_s": [p[2] for p in phases],
            "bubble_s": bubbles,
            "bubble_method": strat.bubble_method,
            # the breakdown's raw material (core/bench/report.py: breakdown)
            "apply_s": {ph: [a.get(ph, 0.0) for a in applies] for ph in apply_phases},
            "final_sync_s": synced - t_sync,  # steady: the trail step's drain, after the measured steps
            "final_sync_apply_s": sum(sync_apply.values()),
            "submit_s": list(self.submits) if timers.scheduler is not None else None,
            "sched_thread_cpu_s": (with_callbacks(thread_cpu_delta(cpu0, cpu1), callback0, callback1)
                                   if commsched else None),
            "sched_engine_cpu_s": ({k: engine1[k] - engine0.get(k, 0.0) for k in engine1}
                                   if commsched and engine0 is not None and engine1 is not None else None),
            "measured_pieces": (pieces1 - pieces0) if pieces0 is not None and pieces1 is not None else None,
            "cpu": cpu,
            "checksum": checksum,
            "stats": stats,
        }

    def resume(self) -> None:
        """Before this strategy's next block of an interleaved phase: its timers on again, and ``auto``'s tuner
        told that the time since its last step was another strategy's (``exclude_pause``)."""
        self.timers.active = True
        if self.sspec.is_commsched:
            self.strat.optimizer.exclude_pause()

    def timeline_files(self, rank: int, world_size: int) -> list[str]:
        """The trace this rank wrote (the plugin adds a rank suffix), if any."""
        if not self.timeline:
            return []
        return [p for p in (rank_path(self.timeline, rank, world_size),) if os.path.exists(p)]

    def close(self) -> None:
        self.timers.close()
        self.strat.close()


def run_train(spec: dict, rank: int, progress: Progress) -> dict:
    """``warmup`` + ``steps`` steps of one strategy, timed on every rank (see :class:`StepTimers`)."""
    workload, model, x, y = _setup(spec, rank)
    try:
        trainer = _Trainer(spec, rank, spec["strategy"], workload, model, x, y)
    except StrategyUnavailable as exc:
        return {"skipped": str(exc)}
    try:
        trainer.warm_up(spec["warmup"], progress)
        result = trainer.measure(spec["steps"], progress)
    finally:
        trainer.close()
    result["timeline"] = trainer.timeline_files(rank, spec["world_size"])
    return result


def run_interleave(spec: dict, rank: int, progress: Progress) -> dict:
    """Every strategy of ``spec["strategies"]`` in this one process, each on its own copy of the model (the
    same initial weights and data), in ``spec["blocks"]`` blocks each: after every strategy's warm-up (and
    ``auto``'s tuning), block b runs the strategies in row b of :func:`round_order` (a Williams design), each
    for one unmeasured lead step (its model back in the caches after another's), ``steps`` measured steps and
    one unmeasured trail step whose start ends the last (:meth:`_Trainer.measure`, ``steady``), then drained, so
    no strategy's communication runs into another's turn. Two strategies' blocks are seconds apart, not a phase:
    the host's slow stretches fall on both (``commsched bench --interleave``, docs/bench.md).

    Returns ``{"interleaved": {strategy: [one result per block, with "position"] | {"skipped": why}}}``."""
    from commsched.bench.runner import round_order

    workload, model, x, y = _setup(spec, rank)
    names, blocks, steps = spec["strategies"], spec["blocks"], spec["steps"]
    out: dict[str, Any] = {}
    trainers: list[tuple[str, _Trainer]] = []
    try:
        for n, name in enumerate(names):
            if n:  # a fresh copy: the same initial weights as the first (every rank alike)
                torch.manual_seed(spec["seed"])
                model = workload.build()
            try:
                trainers.append((name, _Trainer(spec, rank, name, workload, model, x, y)))
            except StrategyUnavailable as exc:
                out[name] = {"skipped": str(exc)}
            else:
                trainers[-1][1].timers.active = False  # on during its own turns only
        for name, trainer in trainers:
            trainer.timers.active = True
            trainer.warm_up(spec["warmup"], progress)
            trainer.strat.synchronize()
            trainer.timers.active = False
            out[name] = []
        total = blocks * len(trainers) * steps
        done = 0

        def tick(_label: str, i: int, _n: int) -> None:
            progress("interleaved blocks", done + i, total)

        for block in range(blocks):
            for position, which in enumerate(round_order(len(trainers), block)):
                name, trainer = trainers[which]
                trainer.resume()
                trainer.step()  # the lead step: not measured
                result = trainer.measure(steps, tick, steady=True)
                trainer.timers.active = False
                done += steps
                result["position"] = position
                result["timeline"] = []
                out[name].append(result)
    finally:
        for _, trainer in trainers:
            trainer.close()
    return {"interleaved": out}


def start_rank(argv: list[str] | None, description: str) -> tuple[dict[str, Any], int]:
    """What every rank the runner starts does first (bench, profile and probe workers): read
    ``--spec``/``--rank``, and die with the runner. Returns the spec and the rank."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    with open(args.spec) as f:
        return json.load(f), args.rank


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; exit 0 with a result file, non-zero on error."""
    spec, rank = start_rank(argv, "commsched bench worker (started by the runner)")
    progress = Progress(spec["run_dir"], rank == 0)
    out = os.path.join(spec["run_dir"], f"rank{rank}.json")
    try:
        if spec["mode"] == "baseline":
            result = run_baseline(spec, rank, progress)
        elif spec["mode"] == "calibrate":
            result = run_calibrate(spec, rank, progress)
        elif spec["mode"] == "interleave":
            result = run_interleave(spec, rank, progress)
        else:
            result = run_train(spec, rank, progress)
    except Exception:  # noqa: BLE001 - any failure: print it, exit non-zero at once
        traceback.print_exc()
        sys.stderr.flush()
        # Peers blocked in a collective with us would otherwise wait for the
        # full collective timeout; exiting now closes our sockets at once.
        os._exit(1)
    result["rank"] = rank
    _write_json(out, result)
    if dist.is_initialized():
        dist.destroy_process_group()
    # gloo sometimes aborts during interpreter teardown ("terminate called without an
    # active exception") even after destroy_process_group(); the result
    # is written and every scheduler closed, so skip the teardown rather than let a
    # finished run look failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
