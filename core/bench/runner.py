"""Run a benchmark: build the emulated cluster, run the phases, collect results.

One *phase* is one launch of all worker processes: first the baseline, then
one per strategy (a fresh process group each, so a crash or a leftover thread
of one strategy cannot touch the next). With ``rounds`` > 1 every strategy runs
once per round, each round in another order (:func:`round_order`, a Williams design), so a slow
stretch of a shared machine falls on different strategies in different rounds
and the report can pair each strategy with the baseline strategy of the same
round (docs/bench.md, "Rounds"). Each phase has a deadline; a worker
that fails or hangs is killed by pid and the phase is reported as failed,
and the run goes on with the next strategy.

Framework-free: the worker is a module of a plugin (``worker_module``, run as
``python -m``) and the plugin says which strategies cannot run here
(``unavailable``); this module imports neither.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from commsched.bench.netns import Cluster, NetnsCluster
from commsched.bench.procs import WorkerError, WorkerGroup, free_ports
from commsched.bench.report import cpu_use, median, summarize_baseline
from commsched.bench.spec import StrategySpec, file_safe
from commsched.progress import Progress

#: Inside a namespace the port space is the run's own: any fixed port is free.
NETNS_MASTER_PORT = 29500


@dataclass
class RunConfig:
    """Everything a run needs, validated by the CLI."""

    workload: str
    workers: int
    nodes: int
    bandwidth: str | None
    intra_bandwidth: str | None
    strategies: list[StrategySpec]
    steps: int
    warmup: int
    batch_size: int
    partition_bytes: int
    credit_bytes: int
    network: str
    timeline_dir: str | None = None
    seed: int = 0
    phase_timeout_s: float = 900.0
    collective_timeout_s: float = 120.0
    baseline_steps: int = field(default=0)  # 0: derived from steps
    calibrate: bool = False  # choose batch_size so the workload is in its regime (Runner.calibrate)
    rounds: int = 1  # every strategy this many times, interleaved (round_order)
    #: a strategy's phase in which the hypervisor took more than this share of the machine's CPU (its
    #: ``cpu_steal``) runs again, up to ``steal_retries`` more times; None: never (Runner.train_phase)
    max_steal: float | None = None
    steal_retries: int = 2
    #: > 0: every strategy in one phase, in this many blocks of ``steps`` measured steps each, alternating
    #: (Runner.interleaved); each block is reported as a round. 0: one phase per strategy and round
    interleave: int = 0

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        check_max_steal(self.max_steal, "max_steal")
        if self.steal_retries < 0:
            raise ValueError(f"steal_retries must be >= 0, got {self.steal_retries}")
        check_interleave(self.interleave, self.rounds, self.max_steal, self.timeline_dir, self.strategies)
        if self.baseline_steps <= 0:
            self.baseline_steps = max(3, min(self.steps, 10))


def check_interleave(blocks: int, rounds: int, max_steal: float | None, timeline_dir: str | None,
                     strategies: list[StrategySpec]) -> None:
    """Refuse an interleaved run (``--interleave BLOCKS``; 0: off) that cannot be one: too few blocks to pair, or
    with an option that needs a phase per strategy."""
    if blocks == 0:
        return
    if blocks < 2:
        raise ValueError(f"--interleave is the number of blocks per strategy, >= 2 to pair them (0: off), got {blocks}")
    if rounds > 1:
        raise ValueError(f"--interleave {blocks} and --rounds {rounds} both repeat every strategy: give one (each "
                         "block is reported as a round)")
    if max_steal is not None:
        raise ValueError("--max-steal runs a phase again, and an interleaved run is one phase: drop it (each "
                         "block's CPU steal is reported, and commsched.bench.paired marks the blocks that lost "
                         "more than 5 %)")
    if timeline_dir:
        raise ValueError("--timeline: an interleaved run writes no traces (its strategies share one process); "
                         "run the strategy alone with --timeline")
    horovod = [spec.name for spec in strategies if spec.kind == "horovod"]
    if horovod:
        raise ValueError(f"{horovod[0]} cannot share a worker process with other strategies (Horovod's own engine "
                         "and its optimizer hooks): run it without --interleave")


def check_max_steal(value: float | None, name: str) -> None:
    """Refuse a ``max_steal`` (``name``: how the caller spells it, e.g. ``--max-steal``) that is no share of
    the CPU; None (never run again) passes."""
    if value is not None and not 0 <= value < 1:
        raise ValueError(f"{name} is a share of the machine's CPU in [0, 1), e.g. 0.05; got {value}")


@dataclass
class PhaseResult:
    """What one phase produced: per-rank result dicts, or why there are none."""

    name: str
    status: str  # ok | skipped | failed
    ranks: list[dict] = field(default_factory=list)
    reason: str = ""
    round: int = 0  # which round (0-based) of an interleaved run
    position: int = 0  # where in its round's order it ran (0: first after the baseline)
    #: the CPU steal of each earlier run of this phase that ``max_steal`` discarded, in the order they ran
    discarded_steal: list[float] = field(default_factory=list)


#: ``--calibrate`` keeps the batch size within this factor of the workload's default.
CALIBRATE_MAX_FACTOR = 16


def choose_batch_size(trials: list[dict[str, float]], target: float, default: int,
                      max_factor: int = CALIBRATE_MAX_FACTOR) -> int:
    """The batch size that should make ``compute / comm`` equal ``target``, from measured
    ``trials`` (``{"batch_size", "compute_s", "comm_s"}``; comm does not depend on the batch).

    One trial: compute taken as proportional to the batch. Two or more: a line
    ``compute = a + k * batch`` through the last two (fixed per-step costs stay fixed);
    a line that does not grow falls back to proportional. Clamped to
    ``[max(1, default // max_factor), default * max_factor]``.
    """
    if not trials:
        raise ValueError("choose_batch_size needs at least one measured trial")
    if not target > 0:
        raise ValueError(f"target compute/comm must be positive, got {target}")
    comm = median([t["comm_s"] for t in trials])
    last = trials[-1]
    want = target * comm
    batch = last["batch_size"] * want / last["compute_s"]
    if len(trials) >= 2:
        prev = trials[-2]
        if last["batch_size"] != prev["batch_size"]:
            k = (last["compute_s"] - prev["compute_s"]) / (last["batch_size"] - prev["batch_size"])
            if k > 0:
                batch = last["batch_size"] + (want - last["compute_s"]) / k
    lo, hi = max(1, default // max_factor), default * max_factor
    return int(min(hi, max(lo, round(batch))))


def round_order(count: int, round_index: int) -> list[int]:
    """The order in which round ``round_index`` runs ``count`` strategies: a row of a Williams
    design. Row r is ``0, 1, n-1, 2, n-2, ...`` with r added to each entry (mod n); for an odd n
    the rows n..2n-1 are the first n reversed. So over n rounds (2n for an odd n) each strategy
    runs equally often in every position, and each strategy runs right after every other one
    equally often: a slow stretch, or a strategy that leaves the machine warm or its page cache
    full, does not always fall on the same neighbour. A plain rotation would always run strategy
    i + 1 right after strategy i (measured: `planned` two places after `dynamic` in every round)."""
    if count <= 0:
        return []
    base = [0]
    low, high = 1, count - 1
    while len(base) < count:
        base.append(low)
        low += 1
        if len(base) < count:
            base.append(high)
            high -= 1
    period = count if count % 2 == 0 else 2 * count
    r = round_index % period
    row = [(x + r % count) % count for x in base]
    return row[::-1] if r >= count else row


class Runner:
    """Runs the phases of one benchmark on an already-started cluster."""

    def __init__(self, config: RunConfig, cluster: Cluster, work_dir: str, *, worker_module: str,
                 unavailable: Callable[[StrategySpec], str | None] = lambda spec: None,
                 log: TextIO = sys.stderr) -> None:
        """``worker_module`` runs one rank (``--spec PATH --rank R``); ``unavailable(spec)``
        says why a strategy cannot run in this environment (``None``: it may)."""
        self.config = config
        self.worker_module = worker_module
        self.unavailable = unavailable
        self.cluster = cluster
        self.work_dir = work_dir
        self.log = log
        self.total_phases = (1 + (1 if config.interleave else len(config.strategies) * config.rounds)
                             + (2 if config.calibrate else 0))
        self._first = 0  # index of the baseline phase (after any calibration phases)
        #: the baseline phase's compute (forward + backward + optimizer, every rank at once), once it ran:
        #: strategies that model the step (planned) scale a cached profile to it (Profile.drift)
        self.baseline_compute_s: float | None = None
        per_node = config.workers // config.nodes
        self.rank_nodes = [cluster.nodes[r // per_node] for r in range(config.workers)]

    def _spec(self, run_dir: str, mode: str, port: int, strategy: str | None, round_index: int = 0,
              strategies: list[str] | None = None) -> dict:
        c = self.config
        timeline = None
        if strategy is not None and c.timeline_dir:
            suffix = f"-round{round_index + 1}" if round_index else ""  # later rounds keep the first's trace
            timeline = os.path.abspath(os.path.join(c.timeline_dir, f"{file_safe(strategy)}{suffix}.json"))
        return {
            "run_dir": run_dir, "mode": mode, "workload": c.workload,
            "batch_size": c.batch_size, "seed": c.seed, "steps": c.steps, "warmup": c.warmup,
            "baseline_steps": c.baseline_steps, "world_size": c.workers, "nodes": c.nodes,
            "master_addr": self.cluster.nodes[0].address, "master_port": port,
            "ranks": [{"node": n.index, "address": n.address, "ifname": n.ifname}
                      for n in self.rank_nodes],
            "strategy": strategy, "partition_bytes": c.partition_bytes,
            "credit_bytes": c.credit_bytes, "timeline": timeline,
            "collective_timeout_s": c.collective_timeout_s,
            # the cluster as built, for strategies that model it (planned: profile and topology)
            "bandwidth": c.bandwidth, "intra_bandwidth": c.intra_bandwidth, "network": c.network,
            "phase_timeout_s": c.phase_timeout_s, "baseline_compute_s": self.baseline_compute_s,
            # mode "interleave": the strategies that share the phase, and the blocks each runs
            "strategies": strategies, "blocks": c.interleave,
        }

    def run_phase(self, index: int, name: str, mode: str,
                  strategy: str | None = None, round_index: int = 0,
                  strategies: list[str] | None = None, timeout_s: float | None = None) -> PhaseResult:
        """Launch every rank for one phase, wait (``timeout_s``, default ``config.phase_timeout_s``), and read
        their result files."""
        run_dir = os.path.join(self.work_dir, f"{index:02d}_{file_safe(name)}")
        os.makedirs(run_dir)
        port = NETNS_MASTER_PORT if isinstance(self.cluster, NetnsCluster) \
            else free_ports(1)[0]
        spec_path = os.path.join(run_dir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(self._spec(run_dir, mode, port, strategy, round_index, strategies), f, indent=1)
        commands, envs, logs = [], [], []
        for rank, node in enumerate(self.rank_nodes):
            commands.append(node.wrap([sys.executable, "-m", self.worker_module,
                                       "--spec", spec_path, "--rank", str(rank)]))
            envs.append(self._env(rank, node, port))
            logs.append(os.path.join(run_dir, f"rank{rank}.log"))
        progress_path = os.path.join(run_dir, "progress")
        head = f"[{index + 1}/{self.total_phases}] {name}"
        # One bar per phase, on a terminal only (commsched.progress); the line with the
        # phase's outcome stays, in a log as on a terminal.
        with Progress(f"{head} starting", stream=self.log, transient=True) as bar:
            def tick() -> None:
                progress = _read_json(progress_path)
                if progress:
                    bar.update(progress["done"], max(1, progress["total"]), f"{head} {progress['phase']}")

            tick()
            try:
                WorkerGroup.start(commands, envs, logs).wait(timeout_s or self.config.phase_timeout_s, tick)
            except WorkerError as exc:
                bar.note(f"{head}: FAILED")
                return PhaseResult(name, "failed", reason=str(exc))
            ranks = [_read_json(os.path.join(run_dir, f"rank{r}.json"))
                     for r in range(self.config.workers)]
            if any(r is None for r in ranks):
                bar.note(f"{head}: FAILED")
                return PhaseResult(name, "failed", reason=f"a rank wrote no result ({run_dir})")
            skipped = [r["skipped"] for r in ranks if "skipped" in r]
            if skipped:
                bar.note(f"{head}: skipped: {skipped[0]}")
                return PhaseResult(name, "skipped", reason=skipped[0])
            bar.note(f"{head}: done")
        return PhaseResult(name, "ok", ranks)

    def _env(self, rank: int, node: Any, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "GLOO_SOCKET_IFNAME": node.ifname,
            "MASTER_ADDR": self.cluster.nodes[0].address,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.config.workers),
            "LOCAL_RANK": str(rank % (self.config.workers // self.config.nodes)),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # a --workload module:function is imported by the workers too: from where the user ran bench
            "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p),
        })
        return env

    def calibrate(self, target: float) -> dict[str, Any]:
        """Measure compute and comm at the configured batch size and at the one
        :func:`choose_batch_size` predicts for ``target`` (``compute / comm``), then set
        ``config.batch_size`` to the final prediction (the baseline phase measures it).
        Returns what :func:`commsched.bench.report.calibration_block` takes. A calibration
        phase that fails keeps the configured batch size and says so in ``method``."""
        default = self.config.batch_size
        trials: list[dict[str, float]] = []
        batch = default
        for n in range(2):
            self.config.batch_size = batch
            phase = self.run_phase(n, f"calibrate{n + 1}", "calibrate")
            self._first = n + 1
            if phase.status != "ok":
                self.config.batch_size = default
                return {"calibrated": False, "default_batch_size": default, "batch_size": default,
                        "trials": trials, "method": f"calibration phase failed ({phase.reason}); kept batch {default}"}
            trials.append({"batch_size": batch,
                           "compute_s": max(median(r["compute_s"]) for r in phase.ranks),
                           "comm_s": max(median(r["comm_s"]) for r in phase.ranks)})
            nxt = choose_batch_size(trials, target, default)
            if nxt == batch:
                break
            batch = nxt
        self.config.batch_size = choose_batch_size(trials, target, default)
        return {"calibrated": True, "default_batch_size": default, "batch_size": self.config.batch_size,
                "trials": trials,
                "method": ("compute (forward + backward + optimizer, every rank at once) and one all-reduce of all "
                           "gradients, measured at the default batch and at the predicted one; compute fitted as "
                           "a + k * batch through the two, the batch solved for compute / comm = target, clamped to "
                           f"1/{CALIBRATE_MAX_FACTOR}..{CALIBRATE_MAX_FACTOR}x the default; the baseline phase "
                           "measures the result")}

    def run_all(self, on_phase: Callable[[PhaseResult], None] | None = None
                ) -> tuple[PhaseResult, list[list[PhaseResult]]]:
        """Baseline, then every strategy once per round, each round in :func:`round_order`
        (after :meth:`calibrate`, if called). Returns the baseline and, per strategy in the
        configured order, its phases in round order (one per round)."""
        if self.config.timeline_dir:
            os.makedirs(self.config.timeline_dir, exist_ok=True)
        rounds = self.config.rounds
        index = self._first
        baseline = self.run_phase(index, "baseline", "baseline")
        if baseline.status == "ok":
            try:
                self.baseline_compute_s = summarize_baseline(baseline.ranks)["compute_s"]
            except (KeyError, TypeError, ValueError):  # a worker that reports less: nothing to scale to
                self.baseline_compute_s = None
        if self.config.interleave:
            results = self.interleaved(index + 1)
            if on_phase is not None:
                for phases in results:
                    for result in phases:
                        on_phase(result)
            return baseline, results
        results: list[list[PhaseResult]] = [[] for _ in self.config.strategies]
        for round_index in range(rounds):
            for position, which in enumerate(round_order(len(self.config.strategies), round_index)):
                spec = self.config.strategies[which]
                index += 1
                name = spec.name if rounds == 1 else f"{spec.name} (round {round_index + 1}/{rounds})"
                reason = self.unavailable(spec)
                if reason is not None:
                    print(f"[{index + 1}/{self.total_phases}] {name}: skipped: {reason}", file=self.log, flush=True)
                    result = PhaseResult(spec.name, "skipped", reason=reason)
                else:
                    result, index = self.train_phase(index, name, spec.name, round_index)
                    result.name = spec.name
                result.round = round_index
                result.position = position
                results[which].append(result)
                if on_phase is not None:
                    on_phase(result)
        return baseline, results


    def interleaved(self, index: int) -> list[list[PhaseResult]]:
        """``config.interleave``: every strategy that can run here in one phase (the worker's ``mode="interleave"``:
        each on its own copy of the model, alternating in blocks). Returns, per strategy in the configured
        order, one result per block (``round`` the block, ``position`` where in the block's order it ran), so
        the report pairs blocks as it pairs rounds; a strategy that cannot run, or a phase that failed, is one
        skipped or failed result."""
        specs = self.config.strategies
        results: list[list[PhaseResult]] = [[] for _ in specs]
        runnable = []
        for which, spec in enumerate(specs):
            reason = self.unavailable(spec)
            if reason is None:
                runnable.append(which)
            else:
                print(f"[{index + 1}/{self.total_phases}] {spec.name}: skipped: {reason}", file=self.log, flush=True)
                results[which] = [PhaseResult(spec.name, "skipped", reason=reason)]
        if not runnable:
            return results
        names = [specs[which].name for which in runnable]
        # --timeout is what one strategy's phase may take: this phase holds them all
        phase = self.run_phase(index, "interleaved", "interleave", strategies=names,
                               timeout_s=self.config.phase_timeout_s * len(names))
        for which, name in zip(runnable, names, strict=True):
            if phase.status != "ok":
                results[which] = [PhaseResult(name, phase.status, reason=phase.reason)]
                continue
            per_rank = [r["interleaved"][name] for r in phase.ranks]
            if isinstance(per_rank[0], dict):  # {"skipped": why}: the worker could not build it
                results[which] = [PhaseResult(name, "skipped", reason=per_rank[0].get("skipped", "skipped"))]
                continue
            results[which] = [PhaseResult(name, "ok", [blocks[b] for blocks in per_rank], round=b,
                                          position=per_rank[0][b]["position"])
                              for b in range(len(per_rank[0]))]
        return results

    def train_phase(self, index: int, name: str, strategy: str, round_index: int) -> tuple[PhaseResult, int]:
        """Run one strategy's phase; where ``config.max_steal`` is set and the hypervisor took more of the
        machine's CPU than that during its measured steps, run it again (up to ``config.steal_retries``
        more times) and keep the run with the least steal; the others' steal goes to ``discarded_steal``.
        A run that fails or is skipped ends the retries and is the result (a failure is never hidden behind
        an earlier stolen run). Returns the result and the index of the last phase run."""
        limit = self.config.max_steal
        runs: list[tuple[float, PhaseResult]] = []
        while True:
            result = self.run_phase(index, name, "train", strategy, round_index)
            steal = phase_steal(result)
            if limit is None or steal is None or steal <= limit:
                break
            runs.append((steal, result))
            if len(runs) > self.config.steal_retries:
                steal, result = min(runs, key=lambda sr: sr[0])
                print(f"[{index + 1}/{self.total_phases}] {name}: every run lost more than {limit:.0%} of the CPU to "
                      f"the hypervisor; kept the one that lost {steal:.1%}", file=self.log, flush=True)
                break
            self.total_phases += 1
            print(f"[{index + 1}/{self.total_phases}] {name}: the hypervisor took {steal:.1%} of the CPU "
                  f"(--max-steal {limit:.0%}): running it again", file=self.log, flush=True)
            index += 1
        result.discarded_steal = [st for st, r in runs if r is not result]
        return result, index


def phase_steal(result: PhaseResult) -> float | None:
    """The share of the machine's CPU the hypervisor took during a phase's measured steps (rank 0's
    /proc/stat reading, the report's ``cpu_steal``); None for a phase that did not run or measured none."""
    if result.status != "ok":
        return None
    return cpu_use(result.ranks, "cpu")["steal"]


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def make_work_dir() -> str:
    """A fresh temporary directory for one run's specs, logs and results."""
    return tempfile.mkdtemp(prefix="commsched-bench-")
