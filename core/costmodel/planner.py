"""The topology-aware compile-time planner: searches a :class:`~commsched.plan.Plan`.

What it chooses, and what it cannot gain
----------------------------------------
On one bottleneck link, earliest-due-date order (the layer order ``dynamic`` uses)
with pieces is already optimal, so reordering alone cannot beat ``dynamic`` there.
The planner's gains come from what the runtime scheduler does not choose:

1. the **algorithm** of each piece on a two-level topology (flat ring, or
   intra reduce-scatter → inter all-reduce of the shard → intra all-gather);
2. the **piece size** of each tensor (large where latency dominates, small where
   a tensor is urgent) and the **credit**;
3. **fusion** of runs of small tensors into one piece (one collective instead of many);
4. the **order**, where pieces of very different cost compete (a MILP).

Every candidate is scored by the simulator (:func:`commsched.costmodel.simulator.simulate`,
strategy ``planned``), the same model ``commsched simulate`` uses, and the result keeps
the best one. The greedy (EDD) plans of the first stage are candidates too, so the
result is never worse *in the model* than the greedy baseline (or, by the margin rule
below, than the runtime default's own EDD plan); the attribution lists
what each stage gained.

Search, in stages (each records its best step time in ``PlanResult.stages``):

* ``dynamic`` — the benchmark's ``dynamic``: 1 MiB pieces, 4 MiB credit, flat ring, small gradients
  fused up to 256 KiB (the reference the gains are measured from; not a plan candidate of its own);
* ``greedy`` — EDD order for each piece size × credit × fusion threshold × algorithm
  rule (``ring``, ``hierarchical``, or the faster of the two per piece);
* ``sizes`` — coordinate descent on each group's own piece size (×¼, ×4), EDD order;
* ``milp`` — order and algorithm of every unit (a piece, or a run of pieces of one
  group when there are more than ``milp_units``, or of consecutive groups in forward order
  when the groups alone are more) by a mixed-integer programme solved
  by HiGHS with a time limit (status, objective, bound and gap reported), warm-started
  from the best EDD order; then the credit again for that order;
* ``margin`` — if the best is not ahead of the runtime default's EDD plan by more than
  ``PlanSearch.min_gain`` (5 %: the model's error here) in the model, that default plan is
  the result: a predicted gain inside the model's error is no reason to depart from it;
* ``engine`` — if DDP's own shape (``PlanSearch.reducer_buckets``) already hides the
  communication in the model and the best is not more than the margin ahead of it, the plan
  names the framework's reducer (``Plan.engine``) with that bucket size: nothing is left to
  schedule, and DDP's engine runs in C++ what commsched runs per piece in Python.

The MILP: one network resource, non-preemptive units ``u`` with release ``r_u``
(when backward makes the group ready), a duration per algorithm ``d_ua``
(:func:`~commsched.costmodel.collectives.allreduce_s` + the scheduler's CPU per piece),
binaries ``x_ua`` (algorithm) and ``y_uv`` (order, big-M disjunctions), the next
forward's layer ends ``F_l ≥ F_{l-1} + apply_l + fwd_l`` and ``F_l ≥ C_u + apply_l +
fwd_l`` for every unit carrying layer ``l``'s gradients, and the period ``T ≥ F_last``,
``T ≥ C_max − S_min`` (a step's communication fits one period). Minimise ``T``. It
ignores compute slowed by communication (the simulator does not).

Why HiGHS: OR-Tools (CP-SAT) needs numpy ≥ 2 and its own protobuf, which do not resolve
with mxnet's numpy 1.26 and TensorFlow's protobuf pin here; ``highspy`` needs only numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from commsched.costmodel.collectives import allreduce_s
from commsched.costmodel.profile import Profile
from commsched.costmodel.simulator import (SimResult, SimSettings, StrategyModel, fusion_runs, planned_tensors,
                                           simulate)
from commsched.costmodel.topology import Topology
from commsched.plan import ALGORITHMS, ORDERS, Plan, PlanGroup, PlannedPiece, fused_name
from commsched.partition import piece_bounds

__all__ = ["ALGORITHM_RULES", "LARGE_GRAD_BYTES", "PlanResult", "PlanSearch", "greedy_plan", "make_groups", "make_plan",
           "solve_order", "with_order"]

KIB, MIB = 1 << 10, 1 << 20
#: The greedy grid's point that is the runtime's default (``dynamic``'s settings, as a plan): the
#: benchmark's ``dynamic`` (``--partition-mb 1 --credit-mb 4``; ``SchedulerConfig()`` itself is 4 MiB /
#: 16 MiB), small gradients fused up to 256 KiB, flat ring, as the planner's grid names them.
DEFAULT_KNOBS = {"fusion_bytes": 256 * KIB, "partition_bytes": 1 * MIB, "algorithm": "ring", "credit_bytes": 4 * MIB}
#: How the algorithm of each piece is chosen in the greedy stage.
ALGORITHM_RULES = ("ring", "hierarchical", "best")
#: Gradients above this many bytes get the grid of large pieces (:meth:`PlanSearch.for_profile`; also
#: ``commsched advise``'s candidates): thousands of 1 MiB pieces would only add latency and simulation time.
LARGE_GRAD_BYTES = 1 << 30


@dataclass(frozen=True)
class PlanSearch:
    """What the planner searches over, and for how long."""

    partitions: tuple[int, ...] = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
    credits: tuple[int, ...] = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
    fusions: tuple[int, ...] = (0, 256 * KIB, 1 * MIB, 4 * MIB)
    algorithm_rules: tuple[str, ...] | None = None  # None: ring only on one node, else all rules
    time_limit_s: float = 10.0  # the MILP's limit (all its solves together)
    milp_units: int = 32
    milp_candidates: int = 2  # how many of the best greedy configurations the MILP reorders
    size_rounds: int = 2
    size_groups: int = 12  # the coordinate descent tries the largest this many groups
    #: the credit must hold this many of the plan's largest pieces (1: any credit). Measured: with
    #: one piece in flight the link idles for the completion -> next issue latency of each piece
    #: (0.35-0.76 ms of the scheduler's threads per piece, 2 workers at 1 Gbit/s), which the
    #: simulator does not model; a plan of 4 MiB pieces under a 1 MiB credit ran 6 % slower than
    #: `static` on flat comm-heavy although the model put it 5 % ahead.
    min_in_flight: int = 2
    #: where compute and communication share the CPUs (the profile measured ``contention`` or
    #: ``comm_contention`` > 1), the credit must also hold this many seconds of the flat ring's
    #: all-reduce: the scheduler's threads wake late under load (decision -> issue measured
    #: 10-16 ms at the median, 37-45 ms at p95 on compute-heavy, 2 workers at 1 Gbit/s), and a
    #: credit the link drains faster idles it. Measured: compute-heavy's plan of 256 KiB pieces
    #: under a 1 MiB credit (8 ms of the link), 5 % ahead of `dynamic` in the model, ran 0.90x
    #: `dynamic` (paired, 3 rounds), as a 51-piece plan of the same kind ran 0.82x `static`
    #: before. 0 turns it off; a profile with no contention (the zoo's GPUs) is not held to it.
    min_credit_s: float = 0.025
    #: candidates within this share of the best step are ties: the one with the fewest pieces per
    #: step wins (then the deeper credit), and a later stage must gain more than it. Each
    #: collective costs more at runtime than the model's CPU per piece (measured 0.35-0.76 ms of
    #: the scheduler's threads per piece against the 10-14 us micro-benchmark, 0.64-1.31 ms with
    #: 4 workers on 2 cores), so where the model cannot tell two plans apart, fewer collectives is
    #: the safer choice. 2 %, not less: on balanced 2 x 2 at 500 Mbit/s the model put 256 KiB
    #: two-level pieces (284 a step) 0.8 % ahead of 1 MiB ones (77); measured, the 284 pieces
    #: cost 219 ms of scheduler CPU a step against 101 ms and ran 2.52 s against 2.32 s.
    tie_tolerance: float = 0.02
    #: the plan departs from the runtime's default (1 MiB pieces, 4 MiB credit, fusion 256 KiB, flat
    #: ring, EDD order; when the grid holds it) only if the simulator puts it ahead by more than
    #: this share. A smaller predicted gain is inside the model's error (mean 3.9 % on this
    #: machine, docs/simulator.md), and what the model misses runs against the departures it
    #: likes: measured on compute-heavy, a plan of 256 KiB pieces under a 1 MiB credit, 2.9 %
    #: ahead of `dynamic` in the model, ran 18 % behind `static` (0.355 against 0.290 s).
    min_gain: float = 0.05
    #: the ``order`` of the plan when the margin keeps the runtime default: ``"observed"`` (the
    #: default's pieces by the runtime's priority up to ``OBSERVED_STEP``, then every step in one
    #: order made from that step's readiness, with no message per step: ``static``'s mechanism),
    #: ``"priority"`` (rank 0 deciding every step: what ``dynamic`` runs) or ``"fixed"`` (the
    #: simulated EDD order replayed).
    #: Measured on compute-heavy (flat, 2 workers, 1 Gbit/s): the fixed replay of the default
    #: waited 41.7 ms a step in the forward against `dynamic`'s 4.2 ms, since every piece waits
    #: for the one listed before it when a gradient is ready later than the profile says; on
    #: comm-heavy, `static` ran 2-3 % ahead of `dynamic` in every round (docs/planner.md).
    kept_default_order: str = "observed"
    #: the bucket sizes at which the ``engine`` stage weighs DDP's own engine (the framework's bucketed
    #: reducer, every bucket at that size: ``reducer:<MB>``); empty: the plan is always commsched's.
    #: Where DDP's best shape leaves at most ``min_gain`` of its step exposed in the model and the
    #: search's best is not more than ``min_gain`` ahead of it, nothing is left to schedule and the plan
    #: names the reducer: it runs in C++ what commsched runs per piece in Python (measured on flat
    #: compute-heavy: the search's plans 0.947-0.998x the best DDP, torch's reducer under ``auto``
    #: 1.01-1.03x; docs/planner.md, "A plan that names DDP's engine").
    reducer_buckets: tuple[int, ...] = (1 * MIB, 4 * MIB)
    simulated_steps: int = 4

    @classmethod
    def for_profile(cls, profile: Profile, **overrides: Any) -> "PlanSearch":
        """The default grid, moved up for models whose gradients exceed 1 GiB (thousands of
        1 MiB pieces would only add latency and simulation time there)."""
        if profile.grad_bytes > LARGE_GRAD_BYTES:
            base = dict(partitions=(16 * MIB, 64 * MIB, 256 * MIB), credits=(64 * MIB, 256 * MIB, 1024 * MIB),
                        fusions=(0, 16 * MIB), size_rounds=1, size_groups=4)
            return cls(**{**base, **overrides})
        return cls(**overrides)

    def __post_init__(self) -> None:
        for name in ("partitions", "credits", "fusions"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise ValueError(f"PlanSearch.{name}={values!r} must be a non-empty tuple of byte counts")
        if any(v <= 0 for v in self.partitions + self.credits):
            raise ValueError("PlanSearch partitions and credits must be positive byte counts")
        if self.algorithm_rules is not None and (not self.algorithm_rules or any(
                r not in ALGORITHM_RULES for r in self.algorithm_rules)):
            raise ValueError(f"PlanSearch.algorithm_rules={self.algorithm_rules!r}: use some of {ALGORITHM_RULES}")
        if not self.time_limit_s > 0:
            raise ValueError(f"PlanSearch.time_limit_s={self.time_limit_s!r} must be > 0 seconds")
        if self.milp_units < 2:
            raise ValueError(f"PlanSearch.milp_units={self.milp_units!r} must be >= 2")
        if not 0 <= self.tie_tolerance < 0.5:
            raise ValueError(f"PlanSearch.tie_tolerance={self.tie_tolerance!r} must be in [0, 0.5)")
        if not 0 <= self.min_gain < 0.5:
            raise ValueError(f"PlanSearch.min_gain={self.min_gain!r} must be in [0, 0.5)")
        if isinstance(self.min_in_flight, bool) or not isinstance(self.min_in_flight, int) or self.min_in_flight < 1:
            raise ValueError(f"PlanSearch.min_in_flight={self.min_in_flight!r} must be an integer >= 1")
        if self.kept_default_order not in ORDERS:
            raise ValueError(f"PlanSearch.kept_default_order={self.kept_default_order!r}: use one of {ORDERS}")
        if any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in self.reducer_buckets):
            raise ValueError(f"PlanSearch.reducer_buckets={self.reducer_buckets!r} must be positive byte counts "
                             "(or empty: never the reducer)")
        if not (math.isfinite(self.min_credit_s) and self.min_credit_s >= 0):
            raise ValueError(f"PlanSearch.min_credit_s={self.min_credit_s!r} must be >= 0 seconds (0: off)")


@dataclass
class PlanResult:
    """The best plan found, its simulated step, and how the search got there."""

    plan: Plan
    predicted: SimResult
    stages: list[dict[str, Any]] = field(default_factory=list)
    solver: dict[str, Any] = field(default_factory=dict)
    candidates: int = 0
    seconds: float = 0.0

    @property
    def step_time_s(self) -> float:
        return self.predicted.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "exposed_comm_s": self.predicted.exposed_comm_s,
                "overlap_ratio": self.predicted.overlap_ratio, "stages": self.stages, "solver": self.solver,
                "candidates": self.candidates, "seconds": self.seconds}


# ------------------------------------------------------------------ building blocks
def _tensors_forward(profile: Profile) -> list[Any]:
    return [t for layer in profile.layers for t in layer.tensors]


def make_groups(profile: Profile, fusion_bytes: int, partition_bytes: int | dict[str, int]) -> list[PlanGroup]:
    """The tasks of a plan: runs of adjacent small tensors (each under ``fusion_bytes``,
    one element size, together at most ``fusion_bytes``) fused, exactly as the runtime fuses
    them (:func:`~commsched.costmodel.simulator.fusion_runs`); every other tensor alone.

    ``partition_bytes``: one piece size for all, or per group name (missing names: 1 MiB).
    Adjacent in forward order is adjacent in backward, so a fused group waits only for
    tensors that are ready at about the same time.
    """
    runs = fusion_runs(profile, fusion_bytes)
    groups = []
    for run in runs:
        names = tuple(t.name for t in run)
        name = names[0] if len(names) == 1 else fused_name(names)
        part = partition_bytes if isinstance(partition_bytes, int) else partition_bytes.get(name, MIB)
        groups.append(PlanGroup(name, names, int(part)))
    return groups


def _piece_algorithm(topology: Topology, nbytes: int, rule: str) -> str:
    if rule in ALGORITHMS:
        return rule
    ring, hier = allreduce_s(topology, nbytes, "ring"), allreduce_s(topology, nbytes, "hierarchical")
    return "hierarchical" if hier < ring else "ring"


def _plan(profile: Profile, topology: Topology, groups: list[PlanGroup], order: list[tuple[str, int]],
          algorithms: dict[str, str], credit: int, meta: dict[str, Any] | None = None) -> Plan:
    pieces = tuple(PlannedPiece(task, index, algorithms[f"{task}#{index}"]) for task, index in order)
    return Plan(model=tuple(planned_tensors(profile)), groups=tuple(groups), pieces=pieces, credit_bytes=int(credit),
                nodes=topology.nodes, ranks_per_node=topology.ranks_per_node, topology=topology.to_dict(),
                meta=dict(meta or {}))


def _all_pieces(profile: Profile, groups: list[PlanGroup]) -> list[tuple[str, int, int]]:
    """(group, index, bytes) of every piece, groups in forward order, indexes ascending."""
    sizes = {t.name: t for t in _tensors_forward(profile)}
    out = []
    for g in groups:
        numel = sum(sizes[n].numel for n in g.tensors)
        element = sizes[g.tensors[0]].element_size
        for index, (lo, hi) in enumerate(piece_bounds(numel, element, g.partition_bytes)):
            out.append((g.name, index, (hi - lo) * element))
    return out


def _deep_enough(profile: Profile, topology: Topology, groups: list[PlanGroup], credit: int,
                 search: PlanSearch) -> bool:
    """Whether ``credit`` holds ``search.min_in_flight`` of the largest piece and, where the profile
    measured CPU contention, ``search.min_credit_s`` of the flat ring's all-reduce on ``topology``
    (either way, every byte of a step is always enough)."""
    sizes = [b for _, _, b in _all_pieces(profile, groups)]
    if not sizes:
        return True
    total = sum(sizes)
    if credit < min(search.min_in_flight * max(sizes), total):
        return False
    shared_cpus = profile.contention > 1.0 or profile.comm_contention > 1.0
    if search.min_credit_s <= 0 or not shared_cpus or credit >= total:
        return True
    return allreduce_s(topology, credit, "ring") >= search.min_credit_s


def greedy_plan(profile: Profile, topology: Topology, groups: list[PlanGroup], credit: int, rule: str = "best",
                steps: int = 4) -> tuple[Plan, SimResult]:
    """The earliest-due-date plan for these groups: the order in which ``dynamic``'s rule
    (ready pieces by layer, within the credit) starts them in a simulated steady-state
    step, each piece with the algorithm ``rule`` picks; and its simulated step."""
    pieces = _all_pieces(profile, groups)
    algorithms = {f"{g}#{i}": _piece_algorithm(topology, nbytes, rule) for g, i, nbytes in pieces}
    draft = _plan(profile, topology, groups, [(g, i) for g, i, _ in pieces], algorithms, credit)
    settings = SimSettings(steps=steps, trace=False)
    edd = simulate(profile, topology, "planned", settings, plan=draft, plan_order="priority")
    order = [(name.rsplit("#", 1)[0], int(name.rsplit("#", 1)[1])) for name in edd.issue_order]
    if len(order) != len(pieces):  # a piece of step 1 never started (cannot happen: every step ends)
        raise RuntimeError("the simulated EDD step did not start every piece")
    plan = _plan(profile, topology, groups, order, algorithms, credit)
    return plan, simulate(profile, topology, "planned", settings, plan=plan)


#: One greedy candidate: (simulated step s, its knobs: fusion, partition, algorithm rule, credit; plan; result)
Greedy = tuple[float, dict[str, Any], Plan, SimResult]


def greedy_grid(profile: Profile, topology: Topology, search: PlanSearch, rules: tuple[str, ...],
                on_scored: Callable[[], None] | None = None) -> list[Greedy]:
    """The earliest-due-date plan (:func:`greedy_plan`) of every fusion x piece size x algorithm rule x
    credit deep enough (:func:`_deep_enough`) of ``search``, fastest first; ``on_scored`` after each."""
    greedy: list[Greedy] = []
    for fusion in search.fusions:
        for partition in search.partitions:
            groups = make_groups(profile, fusion, partition)
            credits = [c for c in search.credits if _deep_enough(profile, topology, groups, c, search)]
            for rule in rules:
                for credit in credits or [max(search.credits)]:
                    plan, result = greedy_plan(profile, topology, groups, credit, rule, search.simulated_steps)
                    if on_scored is not None:
                        on_scored()
                    knobs = {"fusion_bytes": fusion, "partition_bytes": partition, "algorithm": rule,
                             "credit_bytes": credit}
                    greedy.append((result.step_time_s, knobs, plan, result))
    greedy.sort(key=lambda item: item[0])
    return greedy


def fewest_pieces_of_ties(greedy: list[Greedy], tie_tolerance: float) -> Greedy:
    """Of the candidates within ``tie_tolerance`` of the fastest, the one with the fewest pieces a step, then
    the deeper credit (``PlanSearch.tie_tolerance``: where the model cannot tell plans apart, fewer collectives
    is the safer choice)."""
    fastest = min(g[0] for g in greedy)
    ties = [g for g in greedy if g[0] <= fastest * (1 + tie_tolerance)]
    return min(ties, key=lambda g: (g[3].pieces_per_step, -g[1]["credit_bytes"], g[0]))


def _reducer_engine(profile: Profile, topology: Topology, search: PlanSearch, best_s: float,
                    settings: SimSettings) -> tuple[Plan, SimResult, dict[str, Any]] | None:
    """The ``engine`` stage: a plan that names DDP's own engine, or None to keep commsched's.

    DDP's shape at each of ``search.reducer_buckets`` is simulated (``reducer:<MB>``: every bucket at that
    size, in the order backward makes them); the fastest counts. If its communication is hidden (exposed at
    most ``min_gain`` of its step) and the search's best (``best_s``) is not more than ``min_gain`` ahead of
    it, no schedule has anything to gain that the model can see, and what is left is each engine's own
    overhead, which the model does not price apart: DDP's hooks, copies and launches run in C++, commsched's
    per piece in Python. The plan's groups are then DDP's shape inside commsched (small tensors fused up to
    the bucket size, one piece each, all in flight), for a runtime that cannot run the reducer."""
    if not search.reducer_buckets or topology.world_size < 2:
        return None
    runs = [(simulate(profile, topology, StrategyModel(f"reducer:{b / MIB:g}", "ddp", bucket_bytes=b), settings), b)
            for b in search.reducer_buckets]
    ddp, bucket = min(runs, key=lambda run: (run[0].step_time_s, run[1]))
    hidden = ddp.exposed_comm_s <= search.min_gain * ddp.step_time_s
    if not hidden or best_s < ddp.step_time_s * (1 - search.min_gain):
        return None
    sizes = [t.nbytes for t in _tensors_forward(profile)]
    groups = make_groups(profile, bucket, max([bucket, *sizes]))  # one piece a group
    plan, _ = greedy_plan(profile, topology, groups, max(1, sum(sizes)), "ring", settings.steps)  # all in flight
    plan = dataclasses.replace(plan, order="observed", engine="reducer", bucket_bytes=bucket)
    result = simulate(profile, topology, "planned", settings, plan=plan)
    stage = {"stage": "engine: DDP's reducer", "step_time_s": result.step_time_s, "bucket_bytes": bucket,
             "what": f"DDP's shape ({bucket / MIB:g} MiB buckets) leaves {ddp.exposed_comm_s * 1e3:.1f} ms of its "
                     f"{ddp.step_time_s * 1e3:.1f} ms step exposed (not more than the margin of "
                     f"{100 * search.min_gain:.0f} %) and the search's best ({best_s * 1e3:.1f} ms) is not more than "
                     "the margin ahead: communication is hidden already, so the plan names the framework's own "
                     "reducer (PlanSearch.reducer_buckets)"}
    return plan, result, stage


# --------------------------------------------------------------------------- MILP
@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints a banner on stdout when created; keep the CLI's stdout for its report."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _units(pieces: list[tuple[str, int, int]], limit: int) -> list[list[tuple[str, int, int]]]:
    """Pieces, or runs of consecutive pieces of one group, so that there are at most about ``limit``. Where the
    groups alone outnumber ``limit`` (a 70B decoder's plan has ~720 unfused tensors), runs of consecutive pieces
    in forward order across groups, at most ``limit`` of them: one unit per piece or per group there gave the
    MILP ~260,000 order binaries and a solve of 33 s against its 5 s time limit, most of it building the model."""
    groups = len({name for name, _, _ in pieces})
    if groups > limit:
        per = -(-len(pieces) // limit)
        return [pieces[k:k + per] for k in range(0, len(pieces), per)]
    per = 1
    while True:
        units: list[list[tuple[str, int, int]]] = []
        for piece in pieces:
            if units and units[-1][0][0] == piece[0] and len(units[-1]) < per:
                units[-1].append(piece)
            else:
                units.append([piece])
        if len(units) <= limit or per > len(pieces):
            return units
        per += 1


def solve_order(profile: Profile, topology: Topology, groups: list[PlanGroup], warm: Plan,
                time_limit_s: float, max_units: int = 32, algorithms: tuple[str, ...] = ALGORITHMS
                ) -> tuple[list[tuple[str, int]], dict[str, str], dict[str, Any]]:
    """Order and algorithm of every piece by the MILP of the module docstring (HiGHS).

    Returns the piece order, the algorithm per piece, and the solver's report (status,
    objective and bound in seconds, relative gap, wall time, units, binaries). ``warm``
    (a plan of these groups) is the starting incumbent. ``ImportError`` with the fix
    when ``highspy`` is not installed.
    """
    try:
        import highspy
    except ImportError:
        raise ImportError("the planner's MILP needs HiGHS: pip install highspy==1.16.0 "
                          "(or pip install 'commsched[planner]'); make venv installs it") from None
    layers = profile.layers
    layer_of = {t.name: li for li, layer in enumerate(layers) for t in layer.tensors}
    ready = profile.ready_times()
    group_by_name = {g.name: g for g in groups}
    units = _units(_all_pieces(profile, groups), max_units)
    n = len(units)
    cpu = profile.per_piece_cpu_s + profile.per_piece_link_s  # as the simulator charges each piece
    algos = tuple(a for a in algorithms if topology.nodes > 1 and topology.ranks_per_node > 1) or ("ring",)
    duration = [[sum(allreduce_s(topology, b, a) + cpu for _, _, b in unit) if topology.world_size > 1 else 0.0
                 for a in algos] for unit in units]
    # a unit may run across groups (:func:`_units`): ready when its last group is, carrying every group's layers
    unit_tensors = [[t for g in dict.fromkeys(name for name, _, _ in unit) for t in group_by_name[g].tensors]
                    for unit in units]
    release = [max(ready[layer_of[t]] for t in tensors) for tensors in unit_tensors]
    unit_layers = [sorted({layer_of[t] for t in tensors}) for tensors in unit_tensors]
    backward_end = profile.backward_s + profile.step_overhead_s
    big_m = backward_end + max(release) + sum(max(d) for d in duration) + profile.forward_s + profile.apply_s

    started = time.monotonic()
    with _quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-4)
    h.setOptionValue("threads", 1)
    inf = highspy.kHighsInf
    start = [h.addVariable(lb=release[u], ub=inf) for u in range(n)]
    choose = [[h.addBinary() for _ in algos] for _ in range(n)]
    before = {(u, v): h.addBinary() for u in range(n) for v in range(u + 1, n)}
    ends = [h.addVariable(lb=0, ub=inf) for _ in layers]
    s_min = h.addVariable(lb=0, ub=inf)
    c_max = h.addVariable(lb=0, ub=inf)
    period = h.addVariable(lb=0, ub=inf)

    def busy(u: int) -> Any:
        return sum(duration[u][a] * choose[u][a] for a in range(len(algos)))

    for u in range(n):
        h.addConstr(sum(choose[u]) == 1)
        h.addConstr(s_min <= start[u])
        h.addConstr(c_max >= start[u] + busy(u))
    for (u, v), y in before.items():
        h.addConstr(start[v] >= start[u] + busy(u) - big_m * (1 - y))
        h.addConstr(start[u] >= start[v] + busy(v) - big_m * y)
    for li, layer in enumerate(layers):
        work = layer.apply_s + layer.forward_s
        h.addConstr(ends[li] >= (ends[li - 1] if li else backward_end) + work)
    for u in range(n):
        for li in unit_layers[u]:
            work = layers[li].apply_s + layers[li].forward_s
            h.addConstr(ends[li] >= start[u] + busy(u) + work)
    # one resource: a step's communication takes at least the sum of its units (tightens the bound)
    h.addConstr(c_max - s_min >= sum(busy(u) for u in range(n)))
    h.addConstr(period >= ends[-1])
    h.addConstr(period >= c_max - s_min)

    # warm start: the EDD plan's unit order and algorithms, timed in the MILP's own model
    position = {(p.task, p.index): k for k, p in enumerate(warm.pieces)}
    warm_order = sorted(range(n), key=lambda u: min(position[(g, i)] for g, i, _ in units[u]))
    warm_algo = [algos.index(warm.algorithm_of(f"{units[u][0][0]}#{units[u][0][1]}"))
                 if warm.algorithm_of(f"{units[u][0][0]}#{units[u][0][1]}") in algos else 0 for u in range(n)]
    values: dict[Any, float] = {}
    clock = 0.0
    warm_start = [0.0] * n
    for u in warm_order:
        warm_start[u] = max(release[u], clock)
        clock = warm_start[u] + duration[u][warm_algo[u]]
    rank = {u: k for k, u in enumerate(warm_order)}
    for u in range(n):
        values[start[u]] = warm_start[u]
        for a in range(len(algos)):
            values[choose[u][a]] = 1.0 if a == warm_algo[u] else 0.0
    for (u, v), y in before.items():
        values[y] = 1.0 if rank[u] < rank[v] else 0.0
    previous = backward_end
    for li, layer in enumerate(layers):
        need = max([warm_start[u] + duration[u][warm_algo[u]] for u in range(n) if li in unit_layers[u]],
                   default=0.0)
        previous = max(previous, need) + layer.apply_s + layer.forward_s
        values[ends[li]] = previous
    values[s_min] = min(warm_start)
    values[c_max] = max(warm_start[u] + duration[u][warm_algo[u]] for u in range(n))
    values[period] = max(values[ends[-1]], values[c_max] - values[s_min])
    warm_solution = highspy.HighsSolution()
    column = [0.0] * h.getNumCol()
    for var, value in values.items():
        column[int(var.index)] = value
    warm_solution.col_value = column
    warm_solution.value_valid = True
    h.setSolution(warm_solution)
    h.minimize(period)
    wall = time.monotonic() - started
    info = h.getInfo()
    status = h.modelStatusToString(h.getModelStatus())
    report = {"solver": f"HiGHS {h.version()}" if hasattr(h, "version") else "HiGHS",
              "status": status, "units": n, "binaries": n * len(algos) + len(before),
              "objective_s": float(info.objective_function_value), "bound_s": float(info.mip_dual_bound),
              "gap": float(info.mip_gap) if math.isfinite(info.mip_gap) else None,
              "warm_objective_s": values[period], "seconds": wall, "time_limit_s": float(time_limit_s)}
    solution = h.getSolution().col_value
    order_units = sorted(range(n), key=lambda u: (solution[int(start[u].index)], u))
    order = [(g, i) for u in order_units for g, i, _ in units[u]]
    picked = {}
    for u in range(n):
        a = max(range(len(algos)), key=lambda k: solution[int(choose[u][k].index)])
        for g, i, _ in units[u]:
            picked[f"{g}#{i}"] = algos[a]
    return order, picked, report


# --------------------------------------------------------------------------- search
#: The stages of :func:`make_plan`, in order (what its ``progress`` callback names).
PLAN_STAGES = ("dynamic", "greedy", "sizes", "milp", "engine")


def make_plan(profile: Profile, topology: Topology, search: PlanSearch | None = None, *,
              time_limit_s: float | None = None,
              progress: Callable[[str, int, int], None] | None = None) -> PlanResult:
    """Search the plan with the shortest simulated step for ``profile`` on ``topology``.

    ``time_limit_s`` overrides ``search.time_limit_s`` (the MILP's budget). The result
    is never slower in the simulator than the best greedy (EDD) plan of the grid, unless the
    margin rule keeps the runtime default (``PlanSearch.min_gain``; then never slower than that).
    ``progress(stage, stages_done, candidates_scored)``, if given, is called as each of the
    :data:`PLAN_STAGES` starts and after each scored candidate (``commsched plan``'s bar).
    """
    search = search or PlanSearch.for_profile(profile)
    if time_limit_s is not None:
        search = PlanSearch(**{**search.__dict__, "time_limit_s": float(time_limit_s)})
    started = time.monotonic()
    two_level = topology.nodes > 1 and topology.ranks_per_node > 1
    rules = search.algorithm_rules or (ALGORITHM_RULES if two_level else ("ring",))
    steps = search.simulated_steps
    settings = SimSettings(steps=steps, trace=False)
    stages: list[dict[str, Any]] = []
    scored = [0]
    stage_no = [0]

    def tick(stage: str | None = None) -> None:
        if stage is not None:
            stage_no[0] = PLAN_STAGES.index(stage)
        if progress is not None:
            progress(PLAN_STAGES[stage_no[0]], stage_no[0], scored[0])

    tick("dynamic")

    reference = simulate(profile, topology, "dynamic", settings)
    stages.append({"stage": "dynamic", "step_time_s": reference.step_time_s,
                   "what": "runtime default: 1 MiB pieces, 4 MiB credit, flat ring, fusion 256 KiB, EDD order"})

    # stage 1: greedy (EDD) over the grid
    tick("greedy")

    def scored_one() -> None:
        scored[0] += 1
        tick()

    greedy = greedy_grid(profile, topology, search, rules, on_scored=scored_one)
    default = next((g for g in greedy if g[1] == DEFAULT_KNOBS), None)  # the runtime's settings as a plan
    chosen = fewest_pieces_of_ties(greedy, search.tie_tolerance)
    greedy.remove(chosen)
    greedy.insert(0, chosen)
    best_time, best_knobs, best_plan, best_result = chosen
    by_time = sorted(greedy, key=lambda item: item[0])
    ring_only = [g for g in by_time if g[1]["algorithm"] == "ring"]
    unfused = [g for g in ring_only if g[1]["fusion_bytes"] == 0]
    if unfused:
        stages.append({"stage": "greedy: piece size and credit", "step_time_s": unfused[0][0],
                       "what": "EDD, flat ring, no fusion; best of the size x credit grid", "knobs": unfused[0][1]})
    if ring_only:
        stages.append({"stage": "greedy: + fusion", "step_time_s": ring_only[0][0],
                       "what": "EDD, flat ring; best with fusion of small tensors", "knobs": ring_only[0][1]})
    stages.append({"stage": "greedy: + algorithm", "step_time_s": best_time,
                   "what": "EDD; the algorithm per piece as well (of the plans within the tie tolerance of the "
                           "fastest, the one with the fewest pieces)", "knobs": best_knobs})
    greedy_best = best_time

    # stage 2: each group's own piece size (coordinate descent, EDD order)
    tick("sizes")
    partition_of = {g.name: g.partition_bytes for g in best_plan.groups}
    for _ in range(search.size_rounds):
        improved = False
        largest = sorted(best_plan.groups, key=lambda g: -best_plan.group_numel(g) * best_plan.group_element_size(g))
        for g in largest[:search.size_groups]:
            numel_bytes = best_plan.group_numel(g) * best_plan.group_element_size(g)
            for factor in (0.25, 4.0):
                size = int(partition_of[g.name] * factor)
                if size < 64 * KIB or (factor > 1 and partition_of[g.name] >= numel_bytes):
                    continue
                trial = dict(partition_of, **{g.name: size})
                groups = [PlanGroup(x.name, x.tensors, trial[x.name]) for x in best_plan.groups]
                if not _deep_enough(profile, topology, groups, best_plan.credit_bytes, search):
                    continue
                plan, result = greedy_plan(profile, topology, groups, best_plan.credit_bytes,
                                           best_knobs["algorithm"], steps)
                scored[0] += 1
                tick()
                if result.step_time_s < best_time * (1 - search.tie_tolerance):
                    best_time, best_plan, best_result, partition_of = result.step_time_s, plan, result, trial
                    improved = True
        if not improved:
            break
    stages.append({"stage": "sizes: per-tensor piece size", "step_time_s": best_time,
                   "what": f"coordinate descent on the piece size of the {search.size_groups} largest groups "
                           "(x1/4, x4), "
                           "EDD order"})

    # stage 3: the MILP's order and algorithms for the best configurations, then the credit again
    tick("milp")
    solver: dict[str, Any] = {"solver": "HiGHS", "status": "not run"}
    starts = [(best_plan, best_result)] + [(g[2], g[3]) for g in greedy[1:search.milp_candidates]]
    budget = search.time_limit_s / max(1, len(starts))
    solves = []
    milp_best = math.inf
    for warm, _ in starts:
        groups = list(warm.groups)
        order, algorithms, report = solve_order(profile, topology, groups, warm, budget, search.milp_units)
        solves.append(report)
        for credit in sorted(set(search.credits) | {warm.credit_bytes}):
            if credit != warm.credit_bytes and not _deep_enough(profile, topology, groups, credit, search):
                continue
            plan = _plan(profile, topology, groups, order, algorithms, credit)
            result = simulate(profile, topology, "planned", settings, plan=plan)
            scored[0] += 1
            tick()
            milp_best = min(milp_best, result.step_time_s)
            if result.step_time_s < best_time * (1 - search.tie_tolerance):
                best_time, best_plan, best_result = result.step_time_s, plan, result
    if solves:
        solver = dict(solves[0], solves=solves)
    stages.append({"stage": "milp: order and algorithm", "step_time_s": best_time,
                   "what": "HiGHS MILP order/algorithm per unit, then the credit; kept only where the simulator "
                           "agrees it is faster", "milp_plan_step_s": milp_best})

    if default is not None and best_plan.digest != default[2].digest and best_time > default[0] * (1 - search.min_gain):
        gain = 1 - best_time / default[0]
        best_time, _, best_plan, best_result = default
        stages.append({"stage": "margin: the runtime default kept", "step_time_s": best_time, "knobs": DEFAULT_KNOBS,
                       "what": f"the search's best was {100 * gain:.1f} % ahead of the default's EDD plan in the "
                               f"model, not more than the margin of {100 * search.min_gain:.0f} % "
                               "(PlanSearch.min_gain: the model's error)"})
    # the runtime default kept (by the margin, or the search's own best): nothing in its order to fix
    order = search.kept_default_order if default is not None and best_plan.digest == default[2].digest else "fixed"
    if order != "fixed":
        best_plan = dataclasses.replace(best_plan, order=order)
        best_result = simulate(profile, topology, "planned", settings, plan=best_plan)
        best_time = best_result.step_time_s
        how = ("rank 0 decides every step, as in dynamic" if order == "priority" else
               "step 0 by priority, then step 0's order every step with no message, as in static")
        stages.append({"stage": f"order: the runtime's {order} order", "step_time_s": best_time, "order": order,
                       "what": "the plan is the runtime default's settings, so its pieces go in the runtime's order "
                               f"({how}) instead of a replay of the simulated order (PlanSearch.kept_default_order)"})
    tick("engine")
    engine = _reducer_engine(profile, topology, search, best_time, settings)
    if engine is not None:
        best_plan, best_result, stage = engine
        best_time = best_result.step_time_s
        stages.append(stage)
    for stage, prev in zip(stages[1:], stages[:-1], strict=False):
        stage["gain_s"] = prev["step_time_s"] - stage["step_time_s"]
    predicted = {"step_time_s": best_time, "exposed_comm_s": best_result.exposed_comm_s,
                 "overlap_ratio": best_result.overlap_ratio, "dynamic_step_s": reference.step_time_s,
                 "greedy_step_s": greedy_best, "milp_step_s": milp_best, "stages": stages,
                 "solver": {k: v for k, v in solver.items() if k != "solves"}}
    meta = {"profile_source": profile.source, "made_by": "commsched plan",
            "search": {"partitions": list(search.partitions), "credits": list(search.credits),
                       "fusions": list(search.fusions), "algorithm_rules": list(rules),
                       "time_limit_s": search.time_limit_s}}
    final = dataclasses.replace(best_plan, topology=topology.to_dict(), predicted=predicted, meta=meta)
    return PlanResult(plan=final, predicted=best_result, stages=stages, solver=solver, candidates=scored[0],
                      seconds=time.monotonic() - started)


def with_order(plan: Plan, profile: Profile, topology: Topology, order: str,
               search: PlanSearch | None = None) -> Plan:
    """``plan`` with its pieces (groups, sizes, algorithms, credit) issued in ``order``
    (:data:`commsched.plan.ORDERS`) instead of the one :func:`make_plan` chose, and its prediction
    simulated again for that order (``profile`` and ``topology``: the ones it was made from).
    ``predicted["order_forced"]`` keeps the planner's order and its predicted step, so a side-by-side
    run of both orders (the bench's ``planned+order=<order>``) says what the order costs. The plan
    itself unchanged where ``order`` is its own."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: use one of {', '.join(ORDERS)}")
    if order == plan.order:
        return plan
    steps = (search or PlanSearch.for_profile(profile)).simulated_steps
    forced = dataclasses.replace(plan, order=order)
    result = simulate(profile, topology, "planned", SimSettings(steps=steps, trace=False), plan=forced)
    predicted = dict(plan.predicted, step_time_s=result.step_time_s, exposed_comm_s=result.exposed_comm_s,
                     overlap_ratio=result.overlap_ratio,
                     order_forced={"planner_order": plan.order, "planner_digest": plan.digest,
                                   "planner_step_s": plan.predicted.get("step_time_s")})
    return dataclasses.replace(forced, predicted=predicted)
