"""A discrete-event simulation of data-parallel training steps, per strategy.

Data parallelism is symmetric: every rank runs the same step on the same schedule,
and a collective ends on all ranks together. So one rank is simulated, with two
resources: its **compute lane** (forward, backward, optimizer apply, in program
order) and the **network** (collectives one after another, each costing
:func:`commsched.costmodel.collectives.allreduce_s` on the topology plus the
scheduler's CPU per piece). That is what keeps 128 ranks × a 70B decoder well under
a second. While a collective is on the network, compute runs ``profile.contention``
times slower, and while compute runs, what is left of each collective in flight runs
``profile.comm_contention`` times slower (the two share the machine's CPUs; both
measured by the profiler from one all-reduce beside one step; 1 for the zoo's GPUs).
Each commsched piece also takes ``profile.per_piece_steal_s`` from the compute lane when
it is issued, if the lane is computing: the CPU commsched's own threads spend per piece
where they share the model's cores (measured by ``commsched profile``; 0 on GPUs). A
piece that waited for the one before it to land (the credit held one piece) starts on an
idle link ``profile.handoff_s`` after that one ended: the completion, the dispatch and the
last rank's issue, measured by ``commsched profile`` with one piece in flight. Where the
credit holds more, the next piece is already queued behind the one on the link and pays
nothing. A two-level piece also waits, holding its credit, until ``profile.two_level_skew_s``
after its gradient was ready here: the other ranks' start skew (node 1's ranks start a step
later where ranks share cores), measured by ``commsched profile``; a piece decided later than
that pays nothing, so a shallow credit starves the link where a deep one does not.

The commsched strategies (``fifo``, ``dynamic``, ``static``) are not a second
implementation: their pieces are the scheduler's own :class:`~commsched.task.Task`
and :class:`~commsched.task.Piece` objects, cut by :func:`~commsched.partition.piece_bounds`,
and the next piece is chosen by the same dispatch policy object the runtime uses
(:func:`commsched.policy.replay_policy`), within the credit. Peers are modelled from
what they do:

===============  ==============================================================
strategy         model
===============  ==============================================================
``ddp``          DDP buckets: parameters in reverse order, a bucket closed once
                 it holds its limit: the first 1 MiB, then 25 MiB (``ddp:<MB>``:
                 that cap for every bucket, as torch 2.13); a bucket goes when
                 all its gradients are ready, in bucket order; backward ends when
                 the last bucket is reduced; then the optimizer step
``horovod``      every ``cycle`` (1 ms) the gradients ready so far are fused into
                 collectives of at most the fusion threshold (128 MiB); ``step()``
                 waits for all of them, then the optimizer step
``allreduce``    backward, then one flat all-reduce, then the optimizer step
``fifo``         commsched, one piece per tensor (or fused run), no credit (backward order)
``sync``         ``fifo`` on the synchronous path: ``step()`` waits for every piece, then
                 the optimizer step, as DDP (the hooks and the scheduler's CPU as ``fifo``)
``dynamic``,     commsched, runs of small tensors fused as the runtime fuses them
                 (``fusion_bytes``, 256 KiB: :func:`fusion_runs`; one task, ready with
                 the last of them), pieces of ``partition_bytes`` by priority within
``static``       ``credit_bytes``; cross-iteration: layer *i* of the next
                 forward waits for its own gradients, then applies them
``hierarchical`` ``dynamic`` with every piece reduced by the two-level algorithm
``planned``      a :class:`~commsched.plan.Plan`: its groups (fused small tensors
                 become ready with the last of them), its pieces in its one fixed
                 order every step, each with its own algorithm, within its credit;
                 a plan whose ``engine`` is ``reducer``: DDP's buckets of its
                 ``bucket_bytes`` (as ``reducer:<MB>``)
``slack``        ``dynamic`` ranked by the seed's slack rule instead of layer order
                 (:mod:`commsched.costmodel.slack`, ``SimSettings.slack_alpha``)
===============  ==============================================================

Per strategy: step time (steady state: the mean of the last steps), exposed
communication (time the compute lane waits on the network: the "bubble"), overlap
ratio (the share of network time hidden behind compute, in [0, 1]), pieces per
step, and a Chrome trace of the simulated steps.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import heapq
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from commsched.bench.spec import parse_modifiers, plan_order_of
from commsched.costmodel.collectives import allreduce_phases, allreduce_s
from commsched.costmodel.profile import Profile, TensorSpec, merged_spans, overlap_s
from commsched.costmodel.slack import slack_order
from commsched.costmodel.topology import Topology
from commsched.partition import piece_bounds
from commsched.plan import ORDERS, Plan, PlannedTensor, fused_name
from commsched.policy import PlannedPolicy, PriorityPolicy, Unstarted, replay_policy
from commsched.task import Piece, Task

__all__ = ["SIM_STRATEGIES", "SimResult", "SimSettings", "fusion_runs", "parse_sim_strategy", "planned_tensors",
           "simulate", "simulate_all"]

MB = 1 << 20
UNLIMITED = 1 << 60
#: The simulated network's servers (see ``_Sim``).
SERVERS = ("net", "rs", "ar", "ag")
SIM_STRATEGIES = ("ddp", "ddp:<MB>", "reducer[:<MB>]", "horovod", "allreduce", "fifo", "sync", "dynamic", "static",
                  "hierarchical", "planned", "slack")


@dataclass(frozen=True)
class SimSettings:
    """What the simulated strategies are configured with (the bench's defaults)."""

    partition_bytes: int = 1 * MB
    credit_bytes: int = 4 * MB
    #: runs of adjacent gradients under this size are one task (the runtime's ``fusion_bytes``,
    #: :func:`fusion_runs`); 0: every gradient its own task. ``fifo``, ``dynamic``, ``static``,
    #: ``hierarchical`` and ``slack``; a plan has its own groups.
    fusion_bytes: int = 256 << 10
    ddp_bucket_bytes: int = 25 * MB
    ddp_first_bucket_bytes: int = 1 * MB
    horovod_fusion_bytes: int = 128 * MB
    horovod_cycle_s: float = 1e-3
    steps: int = 5  # simulated; the first is warm-up (no previous step to overlap with)
    trace: bool = True  # record the Chrome trace (the planner, scoring thousands of candidates, does not)
    algorithm: str = "ring"
    slack_alpha: float = 1.0  # the ``slack`` strategy's α (commsched.costmodel.slack)
    #: commsched's next forward updates each range of a gradient of several pieces as its piece lands
    #: while it waits (the torch plugin's ranged apply): only the last piece's share is left after it
    ranged_apply: bool = True

    def __post_init__(self) -> None:
        for name in ("partition_bytes", "credit_bytes", "ddp_bucket_bytes", "ddp_first_bucket_bytes",
                     "horovod_fusion_bytes"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive number of bytes")
        if isinstance(self.fusion_bytes, bool) or not isinstance(self.fusion_bytes, int) or self.fusion_bytes < 0:
            raise ValueError(f"fusion_bytes={self.fusion_bytes!r} must be a number of bytes >= 0 (0: no fusion)")
        if not self.horovod_cycle_s > 0:
            raise ValueError(f"horovod_cycle_s={self.horovod_cycle_s!r} must be > 0")
        if self.steps < 3:
            raise ValueError(f"steps={self.steps!r}: at least 3 (one warm-up, two measured)")


def fusion_runs(profile: Profile, fusion_bytes: int) -> list[list[Any]]:
    """The profile's gradients in forward order, as the runtime fuses them
    (``DistributedOptimizer``'s ``fusion_bytes``): runs of adjacent tensors, each smaller than
    ``fusion_bytes`` and not empty, of one element size, together at most ``fusion_bytes``, are
    one run; every other tensor is a run of its own. Adjacent in forward order is adjacent in
    backward, so a run waits only for tensors ready at about the same time. A split tied embedding
    (``meta["tied_split"]``, :meth:`Profile.with_tied_split`) stays alone, as the runtime keeps it."""
    runs: list[list[Any]] = []
    current: list[Any] = []
    size = 0
    alone = set(profile.meta.get("tied_split") or ())
    for t in (t for layer in profile.layers for t in layer.tensors):
        small = fusion_bytes > 0 and 0 < t.nbytes < fusion_bytes and t.name not in alone
        if small and current and size + t.nbytes <= fusion_bytes and current[0].element_size == t.element_size:
            current.append(t)
            size += t.nbytes
            continue
        if current:
            runs.append(current)
        current, size = ([t], t.nbytes) if small else ([], 0)
        if not small:
            runs.append([t])
    if current:
        runs.append(current)
    return runs


@dataclass(frozen=True)
class StrategyModel:
    """A parsed simulated strategy."""

    name: str
    kind: str  # ddp | horovod | allreduce | commsched
    ordering: str = "dynamic"  # commsched only
    bucket_bytes: int | None = None  # ddp only
    algorithm: str | None = None  # None: the settings' algorithm
    priority: str = "layer"  # commsched only: layer order, or the seed's slack rule
    #: ``<commsched strategy>+tied``: the profile's tied embeddings split (:meth:`Profile.with_tied_split`)
    split_tied: bool = False
    #: ``<commsched strategy>+fuse=<size>``: its own fusion threshold (None: ``SimSettings.fusion_bytes``)
    fusion_bytes: int | None = None
    #: commsched only: the next forward overlaps the reductions (True), or ``step()`` waits for them
    #: all and runs the optimizer once, as DDP does (False: ``sync``, the synchronous path)
    cross_iteration: bool = True
    #: ``planned+order=<order>``: the plan's pieces in that order, not the plan's own (None: the plan's)
    plan_order: str | None = None


def parse_sim_strategy(name: str) -> StrategyModel:
    """``ddp``, ``ddp:<MB>``, ``horovod``, ``allreduce``, ``fifo``, ``sync`` (fifo on the synchronous
    path), ``dynamic``, ``static``, ``hierarchical``, ``planned``, ``slack``; a commsched one may end in
    ``+tied`` (``dynamic+tied``: the tied embedding split) and ``+fuse=<size>`` (``fifo+fuse=4MiB``: its
    own fusion threshold; ``sync+fuse=25MiB``: DDP's shape) and ``planned`` in ``+order=<order>``
    (``planned+order=priority``: the plan's pieces in that order), as ``commsched bench`` runs them."""
    base, *modifiers = name.strip().split("+")
    if modifiers:
        model = parse_sim_strategy(base)
        kinds, fusion = parse_modifiers(name.strip(), modifiers, commsched=model.kind == "commsched",
                                        planned=model.ordering == "planned", allowed=("tied", "fuse", "order"))
        return replace(model, name=name.strip(), split_tied="tied" in kinds, fusion_bytes=fusion,
                       plan_order=plan_order_of(name.strip(), modifiers))
    kind, _, arg = name.strip().partition(":")
    if kind == "reducer":  # torch's reducer under commsched's optimizer: DDP's engine, with explicit buckets
        arg = arg or "25"
    if kind in ("ddp", "reducer"):
        if not arg:
            return StrategyModel(name, "ddp")
        try:
            mb = float(arg)
        except ValueError:
            mb = -1.0
        if not (mb > 0 and math.isfinite(mb)):
            raise ValueError(f"strategy {name!r}: the bucket size must be a positive number of MB, e.g. {kind}:4")
        return StrategyModel(name, "ddp", bucket_bytes=int(mb * MB))
    if arg:
        raise ValueError(f"strategy {name!r} takes no argument; known: {', '.join(SIM_STRATEGIES)}")
    if kind in ("horovod", "allreduce"):
        return StrategyModel(name, kind)
    if kind in ("fifo", "dynamic", "static"):
        return StrategyModel(name, "commsched", ordering=kind)
    if kind == "sync":
        return StrategyModel(name, "commsched", ordering="fifo", cross_iteration=False)
    if kind == "hierarchical":
        return StrategyModel(name, "commsched", ordering="dynamic", algorithm="hierarchical")
    if kind == "planned":
        return StrategyModel(name, "commsched", ordering="planned")
    if kind == "slack":
        return StrategyModel(name, "commsched", ordering="dynamic", priority="slack")
    raise ValueError(f"unknown strategy {name!r}; known: {', '.join(SIM_STRATEGIES)}")


@dataclass
class SimResult:
    """One strategy's simulated step (seconds; per step, steady state)."""

    strategy: str
    step_time_s: float
    exposed_comm_s: float
    comm_busy_s: float
    compute_s: float
    overlap_ratio: float
    pieces_per_step: float
    step_times_s: list[float] = field(default_factory=list)
    trace: list[dict] = field(default_factory=list)
    #: the pieces of one steady-state step (step 1) in the order they started
    issue_order: list[str] = field(default_factory=list)
    #: pieces per step that waited ``Profile.handoff_s`` on an idle link for the piece before them
    handoffs_per_step: float = 0.0

    def trace_json(self) -> str:
        """The simulated steps as Chrome-trace JSON (Perfetto opens it)."""
        return json.dumps({"traceEvents": self.trace, "displayTimeUnit": "ms"})


# ---------------------------------------------------------------- the engine
class _Sim:
    """One rank's compute lane and the network, advanced event by event."""

    def __init__(self, profile: Profile, collective_s: Callable[[int, str | None], float]) -> None:
        self.profile = profile
        self.collective_s = collective_s
        self.now = 0.0
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = 0
        # network: FIFO servers of collectives, each one at a time. "net" carries whole
        # collectives; a two-level all-reduce run as a pipeline (the torch backend's three
        # threads) passes "rs" (intra reduce-scatter), "ar" (inter all-reduce), "ag" (intra
        # all-gather), so consecutive pieces overlap their phases.
        self.queues: dict[str, collections.deque] = {name: collections.deque() for name in SERVERS}
        # per server: [end time, on_done, index in net_spans, trace event or None]
        self.current: dict[str, list | None] = {name: None for name in SERVERS}
        self.net_spans: list[tuple[float, float]] = []
        # Communication runs profile.comm_contention times slower while the compute lane
        # works; ``net_slow`` is whether the collectives in flight are timed that way now.
        self.net_slow = False
        self.comm_contention = profile.comm_contention
        self.collectives = 0
        # compute lane: (kind, label, work seconds, precondition, on_done); kind "mark" records a step
        # boundary, "fire" only calls on_done, the others occupy the lane for their work
        # (work: seconds, or a function of the seconds the lane waited for the task, called as it starts)
        self.lane: list[tuple[str, str, Any, Callable[[], bool], Callable[[], None] | None]] = []
        self.lane_pos = 0
        self.task_left: float | None = None  # work left of the running task
        self.debt = 0.0  # scheduler CPU taken between two tasks, paid by the next one (steal)
        self.task_start = 0.0
        self.waiting_since: float | None = None
        # how long the lane waited just before the task now starting (a step mark in between, no work)
        self.just_waited = 0.0
        self.waits: list[tuple[float, float]] = []
        self.busy: list[tuple[float, float]] = []
        self.trace: list[dict] = []
        self.record = True  # whether trace events are kept
        self.marks: list[float] = []

    # network
    @property
    def net_busy(self) -> bool:
        return any(c is not None for c in self.current.values())

    def send(self, nbytes: int, label: str, done: Callable[[], None], extra_s: float = 0.0,
             algorithm: str | None = None, server: str = "net", seconds: float | None = None,
             contended: bool = True) -> None:
        """Queue a collective on ``server``; it lasts ``seconds`` (default the cost of ``nbytes``
        with ``algorithm``) plus ``extra_s``, ``comm_contention`` times longer beside compute unless
        ``contended`` is False (a time measured with compute beside it already); ``done`` runs when
        it ends."""
        self.queues[server].append((nbytes, label, done, extra_s, algorithm, seconds, contended))
        if self.current[server] is None:
            self._start_next(server)

    def _start_next(self, server: str) -> None:
        queue = self.queues[server]
        if not queue:
            self.current[server] = None
            return
        nbytes, label, done, extra, algorithm, seconds, contended = queue.popleft()
        duration = (self.collective_s(nbytes, algorithm) if seconds is None else seconds) + extra
        if self.net_slow and contended:
            duration *= self.comm_contention
        event = None
        if self.record:
            event = {"name": label, "ph": "X", "pid": 0, "tid": 1 + SERVERS.index(server),
                     "ts": self.now * 1e6, "dur": duration * 1e6, "args": {"bytes": nbytes}}
            self.trace.append(event)
        self.current[server] = [self.now + duration, done, len(self.net_spans), event, contended]
        self.net_spans.append((self.now, self.now + duration))
        self.collectives += 1

    def _sync_net_rate(self) -> None:
        """Retime the collectives in flight when the compute lane starts or stops working:
        what is left of each runs ``comm_contention`` times slower beside compute."""
        factor = self.comm_contention
        if factor == 1.0:
            return
        slow = self.task_left is not None
        if slow == self.net_slow:
            return
        self.net_slow = slow
        scale = factor if slow else 1.0 / factor
        for flight in self.current.values():
            if flight is None or not flight[4]:
                continue
            flight[0] = self.now + (flight[0] - self.now) * scale
            start = self.net_spans[flight[2]][0]
            self.net_spans[flight[2]] = (start, flight[0])
            if flight[3] is not None:
                flight[3]["dur"] = (flight[0] - start) * 1e6

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self._timer_seq += 1
        heapq.heappush(self.timers, (self.now + delay, self._timer_seq, fn))

    # compute
    def steal(self, seconds: float) -> None:
        """The scheduler's threads take ``seconds`` of CPU from the compute lane now: the running
        task ends that much later. Between two tasks (a layer's gradients are issued as its
        backward ends) the next task pays it; a lane that then waits on the network loses
        nothing (the threads ran on the core it left free)."""
        if seconds <= 0.0:
            return
        if self.task_left is not None:
            self.task_left += seconds * self.rate()
        else:
            self.debt += seconds

    def rate(self) -> float:
        """Work seconds done per simulated second: slower while the network is busy."""
        return 1.0 / self.profile.contention if self.net_busy else 1.0

    def run(self, limit_events: int = 50_000_000) -> None:
        events = 0
        while True:
            events += 1
            if events > limit_events:
                raise RuntimeError("the simulation did not finish (a strategy model waits on itself)")
            self._advance_lane_starts()
            self._sync_net_rate()
            candidates = []
            task_end = None
            if self.task_left is not None:
                task_end = self.now + self.task_left / self.rate()
                candidates.append(task_end)
            candidates.extend(c[0] for c in self.current.values() if c is not None)
            if self.timers:
                candidates.append(self.timers[0][0])
            if not candidates:
                if self.lane_pos < len(self.lane):
                    kind, label = self.lane[self.lane_pos][:2]
                    raise RuntimeError(f"the simulated step is stuck before {label!r}: it waits for "
                                       "communication that was never started")
                return
            t = min(candidates)
            if self.task_left is not None:
                # the task ends now when its own end is the next event (exactly: no float residue)
                self.task_left = 0.0 if task_end <= t else self.task_left - (t - self.now) * self.rate()
            self.now = t
            for server in SERVERS:
                ending = self.current[server]
                if ending is not None and ending[0] <= t:
                    self.current[server] = None
                    ending[1]()  # may send more (and start it, on an idle server)
                    if self.current[server] is None:
                        self._start_next(server)
            while self.timers and self.timers[0][0] <= t:
                heapq.heappop(self.timers)[2]()
            if self.task_left is not None and self.task_left <= 0.0:
                self._finish_task()

    def _advance_lane_starts(self) -> None:
        while self.task_left is None and self.lane_pos < len(self.lane):
            kind, label, work, ready, _ = self.lane[self.lane_pos]
            if not ready():
                if self.waiting_since is None:
                    self.waiting_since = self.now
                self.debt = 0.0  # the lane waits: the core is free for the scheduler's threads
                return
            if self.waiting_since is not None:
                self.just_waited = self.now - self.waiting_since
                if self.now > self.waiting_since:
                    self.waits.append((self.waiting_since, self.now))
                    if self.record:
                        self.trace.append({"name": "WAIT", "ph": "X", "pid": 0, "tid": 0,
                                           "ts": self.waiting_since * 1e6,
                                           "dur": (self.now - self.waiting_since) * 1e6})
                self.waiting_since = None
            if kind == "mark":
                self.marks.append(self.now)
                self.trace.append({"name": label, "ph": "i", "s": "p", "pid": 0, "tid": 0, "ts": self.now * 1e6})
                self.lane_pos += 1
                continue
            if callable(work):  # work that depends on how long the lane just waited (ranged apply)
                work = work(self.just_waited)
            self.task_left = work
            self.task_start = self.now
            if work <= 0:
                self._finish_task()
                continue
            self.task_left += self.debt * self.rate()
            self.debt = 0.0

    def _finish_task(self) -> None:
        kind, label, work, _, on_done = self.lane[self.lane_pos]
        self.busy.append((self.task_start, self.now))
        if self.now > self.task_start and self.record:
            self.trace.append({"name": label, "ph": "X", "pid": 0, "tid": 0, "ts": self.task_start * 1e6,
                               "dur": (self.now - self.task_start) * 1e6, "args": {"kind": kind}})
        self.task_left = None
        if kind not in ("overhead", "fire"):  # the step's fixed overhead does not end a wait's use
            self.just_waited = 0.0
        self.lane_pos += 1
        if on_done is not None:
            on_done()


def _always() -> bool:
    return True


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off for one run: a 70B step allocates ~130,000 pieces,
    closures and trace events that live until the run ends, and the collector rescanning
    them all cost 45 % of the run (1.9 s against 1.07 s per simulated step, 128 x 70B,
    ``dynamic`` at 1 MiB). What the run leaves behind is collected afterwards as usual."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# ------------------------------------------------------------ the strategies
def _tensors_by_layer(profile: Profile) -> list[list[TensorSpec]]:
    return [list(layer.tensors) for layer in profile.layers]


def _ddp_buckets(profile: Profile, first: int, cap: int) -> list[list[tuple[int, TensorSpec]]]:
    """DDP's buckets as torch 2.13 rebuilds them after the first step: parameters in the order their
    gradients are ready (reverse layers), each added to the open bucket, which closes once it holds
    at least its limit (``first`` bytes for the first bucket, ``cap`` after), so a bucket can pass
    its limit by one tensor (``torch.distributed._compute_bucket_assignment_by_size``). Measured
    with a comm hook on 2 ranks: compute-heavy's 7.9 MB under ``bucket_cap_mb=4`` goes as 4.82 MB
    (5 tensors) then 3.10 MB, not as a 1 MiB bucket and 4 MiB ones (docs/simulator.md)."""
    buckets: list[list[tuple[int, TensorSpec]]] = [[]]
    size, limit = 0, first
    for li in range(len(profile.layers) - 1, -1, -1):
        for t in reversed(profile.layers[li].tensors):
            buckets[-1].append((li, t))
            size += t.nbytes
            if size >= limit:
                buckets.append([])
                size, limit = 0, cap
    return [b for b in buckets if b]


def simulate(profile: Profile, topology: Topology, strategy: str | StrategyModel,
             settings: SimSettings | None = None, plan: Plan | None = None,
             plan_order: str | None = None) -> SimResult:
    """Simulate ``settings.steps`` steps of ``strategy``; the result is per step, steady state.

    ``planned`` needs ``plan`` (its groups must name the profile's tensors). ``plan_order``
    (default: the strategy's ``+order=<order>``, else the plan's own ``order``): ``"fixed"`` walks the
    plan's listed order; with ``"priority"`` the plan's groups, piece sizes and algorithms are kept but
    its order is not: ready pieces go by (step, first tensor of the group in forward
    order, index) within the credit, as ``dynamic`` does; ``issue_order`` then is that
    earliest-due-date order (how the planner makes its greedy plan). ``"observed"`` (step 0's
    order replayed, as ``static``) is modelled as ``"priority"``, as ``static`` is as ``dynamic``:
    in a simulated steady state every step sees the same readiness, so step 0's order is it."""
    settings = settings or SimSettings()
    model = parse_sim_strategy(strategy) if isinstance(strategy, str) else strategy
    if plan_order is None:
        plan_order = model.plan_order or (plan.order if plan is not None else "fixed")
    if plan_order not in ORDERS:
        raise ValueError(f"plan_order={plan_order!r}: use one of {', '.join(ORDERS)}")
    if model.fusion_bytes is not None:
        settings = replace(settings, fusion_bytes=model.fusion_bytes)
    algorithm = model.algorithm or settings.algorithm
    world = topology.world_size
    if world < 1:
        raise ValueError("the topology has no ranks")
    if model.split_tied:
        if not profile.tied:
            raise ValueError(f"strategy {model.name!r}: the profile names no tied embedding (Profile.tied), "
                             "so there is nothing to split; drop +tied")
        profile = profile.with_tied_split()
    if model.ordering == "planned":
        if plan is None:
            raise ValueError("strategy 'planned' needs a plan (make one with `commsched plan`)")
        plan.check_model(planned_tensors(profile))
        if plan.engine == "reducer":  # DDP's own engine, every bucket at the plan's size (as ``reducer:<MB>``)
            return simulate(profile, topology, StrategyModel(model.name, "ddp", bucket_bytes=plan.bucket_bytes),
                            settings)
    else:
        plan = None  # only 'planned' executes a plan

    costs: dict[tuple[int, str], float] = {}  # most pieces share a size: the closed form once per size

    def collective_s(nbytes: int, piece_algorithm: str | None = None) -> float:
        key = (nbytes, piece_algorithm or algorithm)
        cost = costs.get(key)
        if cost is None:
            cost = costs[key] = allreduce_s(topology, nbytes, key[1]) if world > 1 else 0.0
        return cost

    sim = _Sim(profile, collective_s)
    sim.record = settings.trace
    layers = profile.layers
    n_layers = len(layers)
    ready_at = profile.ready_times()
    steps = settings.steps
    commsched = model.kind == "commsched"
    cross = commsched and model.cross_iteration
    # per (step, layer): gradients of that layer reduced (for the next forward / the optimizer)
    layer_left: dict[tuple[int, int], int] = {}
    step_left: dict[int, int] = {}

    def reduced(step: int, layer: int, count: int = 1) -> None:
        layer_left[(step, layer)] -= count
        step_left[step] -= count

    pieces_total = [0]
    handoffs = [0]  # pieces that waited profile.handoff_s on an idle link
    issue_order: list[str] = []
    # ---- commsched: the scheduler's own objects and policy. A task is one tensor, or with a
    # plan one group of the plan (fused tensors go together once the last of them is ready).
    if model.ordering == "planned":
        assert plan is not None
        policy = (PlannedPolicy(plan) if plan_order == "fixed"
                  else PriorityPolicy(plan.credit_bytes))
    else:
        policy = replay_policy(model.ordering, UNLIMITED if model.ordering == "fifo" else settings.credit_bytes)
    partition = UNLIMITED if model.ordering == "fifo" else settings.partition_bytes
    unstarted = Unstarted()
    in_flight = [0]
    seq = [0]
    layers_of: dict[int, list[int]] = {}  # id(task) -> the layer of each of its tensors
    forward_index = {t.name: i for i, t in enumerate(t for layer in layers for t in layer.tensors)}
    if model.priority == "slack" and plan is None:
        forward_index = slack_order(profile, topology, settings.slack_alpha, algorithm=algorithm).tensor_priority
    tensor_layer = {t.name: li for li, layer in enumerate(layers) for t in layer.tensors}
    # Each tensor's task: (name, member tensors, elements, element size, piece bounds, algorithm per
    # piece). With a plan, the plan's groups; without, the runtime's fusion of small gradients
    # (settings.fusion_bytes). A task of several tensors is submitted once the last of them is ready.
    task_of: dict[str, tuple[str, list[str], int, int, list[tuple[int, int]], Any]] = {}
    if plan is not None:
        for group in plan.groups:
            entry = (group.name, list(group.tensors), plan.group_numel(group), plan.group_element_size(group),
                     plan.bounds(group), plan.algorithm_of)
            task_of.update(dict.fromkeys(group.tensors, entry))
    else:
        for run in fusion_runs(profile, settings.fusion_bytes):
            numel = sum(m.numel for m in run)
            entry = (run[0].name if len(run) == 1 else fused_name([m.name for m in run]), [m.name for m in run],
                     numel, run[0].element_size, piece_bounds(numel, run[0].element_size, partition), None)
            task_of.update(dict.fromkeys(entry[1], entry))
    group_waiting: dict[tuple[int, str], int] = {}  # tasks of several tensors: members not ready yet

    def dispatch(step: int, landed: bool = False) -> None:
        """Start what the policy lets start. ``landed``: called because a piece landed; the
        first piece it starts on an idle link waited for that one, and the link stays idle for
        ``profile.handoff_s`` more (the hand-off between the engine's completion and the last
        rank's issue, measured)."""
        while True:
            piece = policy.next(unstarted, step, in_flight[0])
            if piece is None:
                return
            in_flight[0] += piece.nbytes
            pieces_total[0] += 1
            if piece.task.step == 1:
                issue_order.append(piece.name)

            def done(piece: Piece = piece) -> None:
                in_flight[0] -= piece.nbytes
                piece.task.remaining -= 1
                if piece.task.remaining == 0:
                    for lj in layers_of.pop(id(piece.task)):
                        reduced(piece.task.step, lj)
                dispatch(piece.task.step, landed=True)
            piece_algorithm = piece.algorithm if plan is not None else model.algorithm
            sim.steal(profile.per_piece_steal_s)
            # a two-level piece waits, holding the credit, for the ranks' start skew after its gradient was
            # ready here (Profile.two_level_skew_s); one decided later than that pays nothing
            late = skew_left(piece, piece_algorithm)
            if landed and profile.handoff_s > 0 and link_idle(piece.nbytes, piece_algorithm):
                handoffs[0] += 1
                late = max(late, profile.handoff_s)
            if late > 0:
                sim.after(late, functools.partial(send_piece, piece.nbytes, piece.name, done, piece_algorithm))
            else:
                send_piece(piece.nbytes, piece.name, done, piece_algorithm)
            landed = False

    def skew_left(piece: Piece, piece_algorithm: str | None) -> float:
        """What is left now of the ranks' start skew of a two-level piece (``Profile.two_level_skew_s``,
        counted from when its task was submitted here); 0 for a flat piece."""
        if not profile.two_level_skew_s or not phases_of(piece.nbytes, piece_algorithm):
            return 0.0
        return max(0.0, piece.task.submitted_us * 1e-6 + profile.two_level_skew_s - sim.now)

    def link_idle(nbytes: int, piece_algorithm: str | None) -> bool:
        """Whether the server a piece starts on (a two-level piece's reduce-scatter, else the
        network) has nothing running and nothing queued."""
        server = "rs" if phases_of(nbytes, piece_algorithm) else "net"
        return sim.current[server] is None and not sim.queues[server]

    # what a commsched piece holds the network beyond its closed form: the scheduler's CPU on its
    # path, and the measured excess of each collective where ranks share cores (Profile fields).
    # A two-level piece pays the CPU as it enters its pipeline (the reduce-scatter) and the excess
    # on the slow link's phase (the inter-node all-reduce): charged on the intra-node phase, which
    # the pipeline hides behind the inter-node one, the excess would never delay a piece (measured
    # on 2 nodes x 2 ranks, balanced: the inter-node phase was busy the whole pieces' window, and
    # 18-23 ms a piece against its closed form's 15.4; docs/simulator.md). Where the profile measured
    # the phases of two-level pieces in this step (``Profile.two_level_phases``), each measured phase
    # lasts what was measured instead, compute beside it included.
    piece_extra_s = profile.per_piece_cpu_s + profile.per_piece_link_s

    phase_costs: dict[int, tuple] = {}  # two-level phases once per piece size, as ``costs`` above

    def phases_of(nbytes: int, piece_algorithm: str | None) -> tuple:
        """The three phases of a two-level piece; () where it is one collective (one node, one rank
        per node, nothing to move, or the flat ring). Asked up to three times a piece (its start
        skew, whether its server is idle, its send)."""
        if piece_algorithm != "hierarchical":
            return ()
        phases = phase_costs.get(nbytes)
        if phases is None:
            phases = tuple(allreduce_phases(topology, nbytes, "hierarchical"))
            phases = phase_costs[nbytes] = phases if len(phases) == 3 else ()
        return phases

    def send_piece(nbytes: int, name: str, done: Callable[[], None], piece_algorithm: str | None) -> None:
        """A commsched piece: one collective, or a two-level one through the three-phase pipeline."""
        phases = phases_of(nbytes, piece_algorithm)
        if not phases:
            sim.send(nbytes, name, done, extra_s=piece_extra_s, algorithm=piece_algorithm)
            return
        rs, ar, ag = (phase.seconds for phase in phases)
        measured = profile.two_level_phases or {}

        def timed(phase: str, closed: float, extra: float) -> dict[str, Any]:
            """A phase as measured in this workload's step (``Profile.two_level_phases``: compute beside
            it included, so not slowed again), else its closed form plus ``extra``."""
            if phase in measured:
                stretch, per_piece = measured[phase]
                return {"seconds": stretch * closed + per_piece, "contended": False}
            return {"seconds": closed, "extra_s": extra}

        def gathered() -> None:
            sim.send(nbytes, f"{name} all-gather", done, server="ag", **timed("all_gather", ag, 0.0))

        def reduced_inter() -> None:
            sim.send(nbytes, f"{name} inter all-reduce", gathered, server="ar",
                     **timed("all_reduce", ar, profile.per_piece_link_s))
        rs_time = timed("reduce_scatter", rs, 0.0)
        sim.send(nbytes, f"{name} reduce-scatter", reduced_inter, server="rs",
                 **dict(rs_time, extra_s=profile.per_piece_cpu_s))

    def submit(step: int, name: str, tensors: list[str], numel: int, element_size: int,
               bounds: list[tuple[int, int]], algorithm_of: Callable[[str], str] | None) -> None:
        task = Task(name=name, tensor=None, priority=min(forward_index[t] for t in tensors), step=step,
                    seq=seq[0], future=None, on_done=None, submitted_us=sim.now * 1e6)
        seq[0] += 1
        layers_of[id(task)] = [tensor_layer[t] for t in tensors]
        task.remaining = len(bounds)
        if not bounds:
            for t in tensors:
                reduced(step, tensor_layer[t])
        for index, (lo, hi) in enumerate(bounds):
            piece_name = f"{name}#{index}"
            piece = Piece(task, index, lo, hi, (hi - lo) * element_size, None, piece_name)
            if algorithm_of is not None:
                piece.algorithm = algorithm_of(piece_name)
            policy.add(piece)

    def commsched_ready(step: int, li: int) -> Callable[[], None]:
        def fire() -> None:
            for t in layers[li].tensors:
                entry = task_of[t.name]
                name, members = entry[0], entry[1]
                if len(members) > 1:
                    key = (step, name)
                    group_waiting[key] = group_waiting.get(key, len(members)) - 1
                    if group_waiting[key] > 0:
                        continue
                    del group_waiting[key]
                submit(step, *entry)
            dispatch(step)
        return fire

    # ---- peers
    # DDP's small first bucket is its default's only: with ``bucket_cap_mb`` given (``ddp:<MB>``) every
    # bucket's limit is that cap (measured on torch 2.13, docs/simulator.md)
    cap = model.bucket_bytes or settings.ddp_bucket_bytes
    buckets = _ddp_buckets(profile, cap if model.bucket_bytes else settings.ddp_first_bucket_bytes, cap)
    bucket_of = {t.name: b for b, bucket in enumerate(buckets) for _, t in bucket}
    ddp_state: dict[int, dict[str, Any]] = {}

    def ddp_ready(step: int, li: int) -> Callable[[], None]:
        def fire() -> None:
            st = ddp_state.setdefault(step, {"left": [len(b) for b in buckets], "next": 0})
            for t in layers[li].tensors:
                st["left"][bucket_of[t.name]] -= 1
            while st["next"] < len(buckets) and st["left"][st["next"]] == 0:  # buckets go in order
                bucket = buckets[st["next"]]
                st["next"] += 1
                pieces_total[0] += 1

                def done(bucket: list = bucket) -> None:
                    for lj, _ in bucket:
                        reduced(step, lj)
                sim.send(sum(t.nbytes for _, t in bucket), f"bucket{st['next'] - 1}", done)
        return fire

    hvd_ready: list[tuple[int, int, TensorSpec]] = []
    hvd_timer = [False]

    def hvd_cycle() -> None:
        hvd_timer[0] = False
        while hvd_ready:
            group, size = [], 0
            while hvd_ready and (not group or size + hvd_ready[0][2].nbytes <= settings.horovod_fusion_bytes):
                item = hvd_ready.pop(0)
                group.append(item)
                size += item[2].nbytes
            pieces_total[0] += 1

            def done(group: list = group) -> None:
                for step, lj, _ in group:
                    reduced(step, lj)
            sim.send(size, f"fused x{len(group)}", done)

    def horovod_ready(step: int, li: int) -> Callable[[], None]:
        def fire() -> None:
            hvd_ready.extend((step, li, t) for t in layers[li].tensors)
            if not hvd_timer[0]:
                hvd_timer[0] = True
                sim.after(settings.horovod_cycle_s, hvd_cycle)
        return fire

    def allreduce_after_backward(step: int) -> Callable[[], None]:
        def fire() -> None:
            pieces_total[0] += 1
            sim.send(profile.grad_bytes, "flat all-reduce",
                     lambda: [reduced(step, li, len(layers[li].tensors)) for li in range(n_layers)])
        return fire

    on_ready = {"commsched": commsched_ready, "ddp": ddp_ready, "horovod": horovod_ready}.get(model.kind)

    # ---- the program of the compute lane
    def layer_done(step: int, li: int) -> Callable[[], bool]:
        return lambda: step < 0 or layer_left.get((step, li), 0) == 0

    def step_done(step: int) -> Callable[[], bool]:
        return lambda: step < 0 or step_left.get(step, 0) == 0

    rangeable = None if profile.ranged is None else frozenset(profile.ranged)

    def apply_work(layer: Any) -> float | Callable[[float], float]:
        """The update of ``layer`` in the next forward. Under ranged apply, the part of it that belongs
        to gradients of several pieces (not fused; among ``profile.ranged`` where it names them) is done
        while the forward waits, up to the share of the largest piece, which is left after the last one
        lands."""
        apply_s = layer.apply_s
        total = sum(t.nbytes for t in layer.tensors)
        entries = [(t, task_of.get(t.name)) for t in layer.tensors]
        ranged = [(t, e[4]) for t, e in entries if e is not None and len(e[1]) == 1 and len(e[4]) > 1
                  and (rangeable is None or t.name in rangeable)]
        if not settings.ranged_apply or not ranged or total <= 0 or apply_s <= 0:
            return apply_s
        share = sum(t.nbytes for t, _ in ranged) / total
        tail = max(max(hi - lo for lo, hi in bounds) * t.element_size for t, bounds in ranged) / total
        fixed, in_ranges, last = apply_s * (1 - share), apply_s * share, apply_s * min(tail, share)
        return lambda waited: fixed + (max(last, in_ranges - waited) if waited > 0 else in_ranges)

    # backward order: a layer's gradients are handed over at its ready time
    order = sorted(range(n_layers), key=lambda i: (ready_at[i], -i))
    # the tasks each layer's hooks submit: a task of several tensors is submitted by the hook of
    # the last of its tensors to be ready (per_task_submit_s, once per task)
    position = {li: k for k, li in enumerate(order)}
    closing = [0] * n_layers
    for entry in {entry[0]: entry for entry in task_of.values()}.values():
        members = [tensor_layer[name] for name in entry[1] if name in tensor_layer]
        if members:
            closing[max(members, key=position.__getitem__)] += 1
    lane = sim.lane
    for s in range(steps):
        for li in range(n_layers):
            layer_left[(s, li)] = len(layers[li].tensors)
        step_left[s] = sum(len(layer.tensors) for layer in layers)
        lane.append(("mark", f"step {s}", 0.0, (layer_done(s - 1, 0) if cross else _always), None))
        if profile.step_overhead_s:
            lane.append(("overhead", "step overhead", profile.step_overhead_s, _always, None))
        for li, layer in enumerate(layers):
            if cross:  # the next forward applies layer i once its own gradients are reduced
                lane.append(("apply", f"apply {layer.name}", apply_work(layer), layer_done(s - 1, li), None))
            lane.append(("forward", f"fwd {layer.name}", layer.forward_s, _always, None))
        # backward, cut at the ready times: the gradients of a layer are handed over at its ready time
        previous = 0.0
        for li in order:
            fire = on_ready(s, li) if on_ready is not None else None
            # commsched's hooks, in Python: every gradient's, and the submit of each task it completes
            hooks = (profile.per_grad_hook_s * len(layers[li].tensors) + profile.per_task_submit_s * closing[li]
                     if commsched else 0.0)
            lane.append(("backward", f"bwd {layers[li].name}", max(0.0, ready_at[li] - previous) + hooks, _always,
                         fire))
            previous = max(previous, ready_at[li])
        rest = profile.backward_s - previous
        if rest > 0:
            lane.append(("backward", "bwd (rest)", rest, _always, None))
        if model.kind == "allreduce":
            lane.append(("fire", "all-reduce", 0.0, _always, allreduce_after_backward(s)))
        if not cross:  # DDP blocks in backward, Horovod in step(), allreduce in its step: then the optimizer
            lane.append(("apply", "optimizer step", profile.step_optimizer_s, step_done(s), None))
    # the boundary after the last step is where a next step would start
    lane.append(("mark", "end", 0.0, (layer_done(steps - 1, 0) if cross else _always), None))
    with _collector_paused():
        sim.run()

    marks = sim.marks  # step 0 .. steps-1 starts, then the end
    durations = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    measured = durations[1:]  # step 0 has no previous step to overlap with
    window = (marks[1], marks[-1])
    n = len(measured)
    exposed = overlap_s(sim.waits, window) / n
    net = overlap_s(merged_spans(sim.net_spans), window) / n  # time any collective runs (servers overlap)
    overlap = 0.0 if net <= 0 else min(1.0, max(0.0, 1.0 - exposed / net))
    return SimResult(strategy=model.name, step_time_s=sum(measured) / n, exposed_comm_s=exposed, comm_busy_s=net,
                     compute_s=overlap_s(sim.busy, window) / n, overlap_ratio=overlap,
                     pieces_per_step=pieces_total[0] / steps, step_times_s=measured, trace=sim.trace,
                     issue_order=issue_order, handoffs_per_step=handoffs[0] / steps)


def planned_tensors(profile: Profile) -> list[PlannedTensor]:
    """The profile's gradients as a plan's fingerprint entries."""
    return [PlannedTensor(t.name, t.numel, t.element_size, t.shape, t.dtype)
            for layer in profile.layers for t in layer.tensors]


def simulate_all(profile: Profile, topology: Topology, strategies: list[str],
                 settings: SimSettings | None = None, plan: Plan | None = None) -> list[SimResult]:
    """:func:`simulate` for each strategy, in the order given (``plan`` for ``planned``)."""
    return [simulate(profile, topology, name, settings, plan=plan) for name in strategies]
