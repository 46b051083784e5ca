"""Changing scheduler settings during training: the agreed step boundary, and the online tuner of
``SchedulerConfig(ordering="auto")``. Framework-free; a plugin drives both at its step boundaries.

The agreed boundary (:class:`AgreedSwitch`), two-phase
-------------------------------------------------------
Ranks issue collectives in an agreed order, so a change of ordering, piece size, credit or
fusion must take effect on every rank at the same step, with nothing in flight:

1. *decide at step k*: at the end of step ``k`` rank 0 (the only rank that measures and
   decides) publishes a :class:`Decision` under ``<prefix>/switch/<k>`` in the store;
2. *apply at step k+2*: at the end of step ``k + 1`` every rank takes that decision (rank 0
   its own; the others a store ``get`` bounded by ``timeout_s``: rank 0 published it one
   step earlier, so it is there), waits until every piece is reduced and applied
   (``synchronize()``), and rebuilds its scheduler; step ``k + 2`` runs the new settings.

Every rank knows in advance at which steps decisions are made: the first one is fixed when
training starts, and each decision names the next (``Decision.next``), so no rank ever polls
the store on other steps and no rank waits on a decision that will not come.

The tuner (:class:`Tuner`)
--------------------------
Rank 0 only. A *sample* is one setting run for ``settle`` steps (not scored: the switch
itself) plus ``sample_steps`` scored steps; its score is the median step period (the periods
of several samples of one setting, pooled, score by their interquartile mean, :func:`location`), its noise
the spread of those periods (:func:`spread`: half the inter-quartile range at 4 periods, shrinking
as sqrt(4 / n) for more pooled periods of one setting; at least 0.5 % of the median).
The first samples are the start points (the cost model's recommendations when there are any,
:func:`model_starts`: the planner's plan where it is predicted ahead of the runtime settings
by more than the model's error, then the advised runtime setting), the config's own settings
(where the driver searches ``direct_start``, :attr:`SearchSpace.direct_starts`, also with it the other
way) and plain ``fifo`` without partition or credit, cross-iteration and then on the synchronous
path (``step()`` waits and applies once, as DDP: what wins where communication is hidden already
and the cores are busy; the synchronous one only where the driver may switch paths); then a
sampler proposes (Optuna's TPE: ask/tell over the
discrete :class:`SearchSpace`). A sample replaces the incumbent only if its median beats
the incumbent's by more than both spreads; such a winner is *confirmed* by a second sample
of the same setting before it is kept (the incumbent is thus always measured at least
twice: horovod#2207 shows single autotune scores varying by 8 %); an incumbent measured once
only (a start point) is measured again before such a winner replaces it, and the winner must
beat its two samples pooled (one unlucky sample cannot lose it either). A sample faster than
the incumbent by more than its own noise but not by the incumbent's is inconclusive: the
incumbent's noise decides, so the incumbent is measured again (up to ``remeasure_samples``
samples in all) and scored on its pooled periods. Without it one bimodal first sample
(periods 0.27, 0.37, 0.26, 0.35 s: a spread of 14 %) outlived 19 samples up to 13 % faster
(compute-heavy, 2 workers, 1 Gbit/s, 2026-12-05).

The search stops when the *predicted gain* is below ``min_gain`` (2 %): the best improvement over
the incumbent among the last ``patience`` samples, an empirical estimate of what another sample
brings, is smaller than that; or after ``max_samples - race_width * race_samples`` samples. Then, with
``race_samples`` > 0, a *final race*: the incumbent's score is the smallest of many noisy scores,
so it is biased low and may belong to a setting that only had a lucky sample. The runners-up (the
other settings of the round with the lowest medians over all their periods, up to
``race_width - 1`` of them: 1 by default, 2 in the plugin), each within ``race_margin`` (5 %; 8 % in
the plugin) of the incumbent's score, and the incumbent are each measured ``race_samples`` times afresh, in
rounds whose order reverses (runner-up, incumbent, incumbent, runner-up; three wide: A, B,
incumbent, incumbent, B, A: a steady drift of the machine favours none), and the one with the
lowest median over its race periods is kept (a tie keeps the incumbent); without such a runner-up
the incumbent alone is measured afresh. A third setting in the race gives a start judged on one
search sample taken in a slow moment a second look (compute-heavy, 2026-12-06: torch's reducer
scored once 6 % behind and was never measured again; docs/tuning.md). With ``race_extend`` (the
plugin's default), a race whose two lowest medians differ by no more than their noise (the larger
:func:`spread` of the two settings' race periods) runs another block of those two only, in the
race's order, as long as the samples the search left unused allow, and is decided on all their
periods. So at most ``max_samples`` (20) samples in all. A *favoured* setting (``favoured``: the cost
model's pick where it cannot price what separates the candidates; the PyTorch plugin's is torch's reducer
where the planner names DDP's engine, :func:`model_starts`) races whatever its search samples scored, in
place of the last runner-up, and is kept unless another setting's race median beats its own by more than
their noise (an extension then runs between the leader and it): compute-heavy, 2026-12-07, the reducer's
one search sample fell in a slow moment and it never raced, and ``auto`` kept ``dynamic``, which ran 0.88x
``ddp:1``. In the study below (4 starts, one 3 % ahead, the machine wandering 6 %), favouring the best
start cut the kept setting's mean excess from 0.71 % to 0.18 % and favouring another start raised it to
0.95 % (docs/tuning.md). Where the model picks nothing, ``safe`` settings (the plugin's: torch's reducer,
DDP's own engine) stand in: the one of them with the lowest search score is favoured in that race, so
commsched's own path replaces DDP's engine only where it measured faster. ``favour_z``: the favoured
setting is beaten only by more than ``favour_z`` standard errors of the difference of the two race
medians (``favour_z x sqrt(s_f^2 + s_l^2)``, ``s`` each one's :func:`spread`), not by more than the larger
spread (None, the default): a one-sided test at about 90 % for the plugin's 1.28 (docs/tuning.md, "DDP's
engine as the safe choice"). Over 300 seeded runs of 9 settings within
12 % of each other under a wandering machine speed (``scripts/tuner_study.py``), 2 race samples
each cut the kept setting's mean excess over the best from 2.25 % to 1.63 % and the kept score's
bias from -1.96 % to -0.55 %, for 3.6 more samples; extending unresolved races cut the excess
from 1.66 % to 1.56 % there, and from 2.22 % to 1.95 % where 30 % of steps run 15 % slower
(bimodal), for 1.4-1.5 more samples (docs/tuning.md).

Settled, it checks every ``check_every`` steps whether the median period of the steps since the
last check drifted more than ``drift`` (5 %) and more than twice the noise (the larger spread of
the two) from the *reference*: the median of the first such window after settling (up to
``check_every`` periods of the kept setting, not the few that scored it), and re-tunes (from the
incumbent) if so. Compared, as before, from the last 4 periods with the score, a setting whose
periods vary 5 % a step independently (nothing drifting) re-tuned within 300 steps of settling in
39 % of 300 seeded runs (the same study); now in none. One log line per decision
(logger ``commsched.tuner``); :meth:`Tuner.stats` has the history. While it tunes, a bar of samples
(``commsched.progress``) is drawn on rank 0's terminal (never in a log or CI); :meth:`Tuner.close`
removes it.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Protocol

from commsched.errors import CommschedError, CommschedTimeout
from commsched.progress import Progress

__all__ = ["AgreedSwitch", "DDP_BUCKET_BYTES", "DDP_SMALL_BUCKET_BYTES", "Decision", "PLANNED", "REDUCER",
           "SearchSpace", "Settings", "Tuner", "UNLIMITED_BYTES", "OptunaSampler", "Sampler", "ModelStarts",
           "model_starts", "spread"]

log = logging.getLogger("commsched.tuner")

#: "No partition" / "no credit": larger than any tensor (what the benchmark's ``fifo`` uses).
UNLIMITED_BYTES = 1 << 40
KIB, MIB = 1 << 10, 1 << 20
#: DDP's default bucket (``bucket_cap_mb=25``): as a fusion threshold on the synchronous path, fifo
#: without partition reduces gradients as DDP does, a few large fused collectives and one wait at
#: ``step()`` (the start point of ``auto`` where communication is hidden already)
DDP_BUCKET_BYTES = 25 * MIB
#: ``bucket_cap_mb=1`` (the bench's ``ddp:1``), the fastest DDP where the link is shaped (compute-heavy
#: and gpt2 at 1 Gbit/s, docs/tuning.md): as a fusion threshold on the synchronous path, DDP's shape
#: with small buckets reduced during backward, the start point of ``auto`` beside the 25 MiB one
DDP_SMALL_BUCKET_BYTES = 1 * MIB
#: The ordering of a start point that runs a plan of the cost model's planner (:func:`model_starts`);
#: outside :class:`SearchSpace` (a plan is one point, made for this model and topology, not a grid axis)
PLANNED = "planned"
#: ``Settings.ordering`` of a start where torch's own C++ reducer (DDP's) reduces the gradients in buckets of
#: ``fusion_bytes``, on the synchronous path, and commsched schedules nothing (PyTorch plugin; where
#: communication is hidden already its per-piece Python costs what no schedule wins back: docs/tuning.md)
REDUCER = "reducer"


@dataclass(frozen=True)
class Settings:
    """The scheduler settings the tuner chooses between (the fields of ``SchedulerConfig`` it may change)."""

    ordering: str
    partition_bytes: int
    credit_bytes: int
    fusion_bytes: int
    #: ``ordering="planned"``: the digest of the plan the cost model made for this run (the driver
    #: holds the plan itself and sends it with the decision); its sizes and credit are the plan's
    #: (``partition_bytes`` and ``fusion_bytes`` 0: the plan's own per group); "" for the other orderings
    plan: str = ""
    #: False: the synchronous path (``SchedulerConfig(cross_iteration=False)``): ``step()`` waits for
    #: every reduction and runs the wrapped optimizer once, as DDP does. No forward waits and no
    #: per-layer applies; what wins where communication is hidden already and the cores are busy
    cross_iteration: bool = True
    #: ``SchedulerConfig(direct_start=...)``: a piece's completion (on an engine whose callback may start
    #: collectives) and the order thread start what they freed, without waking the dispatch thread.
    #: Measured both ways by workload (faster on comm-heavy, slower where compute fills the cores:
    #: docs/tuning.md), so the tuner's to choose; no meaning for torch's reducer (False there)
    direct_start: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Settings":
        return cls(str(data["ordering"]), int(data["partition_bytes"]), int(data["credit_bytes"]),
                   int(data["fusion_bytes"]), str(data.get("plan", "")), bool(data.get("cross_iteration", True)),
                   bool(data.get("direct_start", False)))

    def describe(self) -> str:
        direct = " direct-start" if self.direct_start else ""
        if self.ordering == PLANNED:
            return f"planned (plan {self.plan[:12]}, credit={_size(self.credit_bytes)}){direct}"
        if self.ordering == REDUCER:
            return f"torch's reducer (DDP's, buckets {_size(self.fusion_bytes)}) synchronous"
        return (f"{self.ordering} partition={_size(self.partition_bytes)} credit={_size(self.credit_bytes)} "
                f"fusion={_size(self.fusion_bytes) if self.fusion_bytes else 'off'}"
                + ("" if self.cross_iteration else " synchronous") + direct)


def _size(n: int) -> str:
    if n >= UNLIMITED_BYTES:
        return "none"
    return f"{n // MIB}MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB}KiB" if n % KIB == 0 else str(n)


@dataclass(frozen=True)
class SearchSpace:
    """The discrete choices of the tuner. ``UNLIMITED_BYTES`` as a partition or credit means none."""

    orderings: tuple[str, ...] = ("dynamic", "static", "fifo")
    partitions: tuple[int, ...] = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, UNLIMITED_BYTES)
    credits: tuple[int, ...] = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, UNLIMITED_BYTES)
    fusions: tuple[int, ...] = (0, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, DDP_BUCKET_BYTES)
    #: cross-iteration overlap on (True) or the synchronous path (False); ``(False,)`` where the user
    #: asked for the synchronous path, ``(True, False)`` where the tuner may choose
    cross_iterations: tuple[bool, ...] = (True, False)
    #: ``direct_start`` off only (``(False,)``, the default), on only, or both (``(False, True)``: the
    #: PyTorch plugin's where the engine's completions may start collectives, gloo's path)
    direct_starts: tuple[bool, ...] = (False,)

    def __post_init__(self) -> None:
        known = ("dynamic", "static", "fifo")
        if not self.orderings or any(o not in known for o in self.orderings):
            raise ValueError(f"SearchSpace.orderings={self.orderings!r}: use some of {known}")
        for name in ("partitions", "credits", "fusions"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
                raise ValueError(f"SearchSpace.{name}={values!r} must be a non-empty tuple of byte counts")
        if any(v <= 0 for v in self.partitions + self.credits):
            raise ValueError("SearchSpace partitions and credits must be positive byte counts")
        if not self.cross_iterations or any(not isinstance(v, bool) for v in self.cross_iterations) or \
                len(set(self.cross_iterations)) != len(self.cross_iterations):
            raise ValueError(f"SearchSpace.cross_iterations={self.cross_iterations!r}: use (True, False), (True,) "
                             "or (False,)")
        if not self.direct_starts or any(not isinstance(v, bool) for v in self.direct_starts) or \
                len(set(self.direct_starts)) != len(self.direct_starts):
            raise ValueError(f"SearchSpace.direct_starts={self.direct_starts!r}: use (False, True), (False,) "
                             "or (True,)")

    def nearest(self, s: Settings) -> Settings:
        """``s`` moved onto the grid (each value to the nearest choice; an unknown ordering to the first)."""
        def near(values: tuple[int, ...], v: int) -> int:
            return min(values, key=lambda c: (abs(c - v), c))
        return Settings(s.ordering if s.ordering in self.orderings else self.orderings[0],
                        near(self.partitions, s.partition_bytes), near(self.credits, s.credit_bytes),
                        near(self.fusions, s.fusion_bytes), cross_iteration=s.cross_iteration
                        if s.cross_iteration in self.cross_iterations else self.cross_iterations[0],
                        direct_start=s.direct_start if s.direct_start in self.direct_starts else self.direct_starts[0])


class Sampler(Protocol):
    """Proposes the next setting to measure and learns each score (smaller is better)."""

    def ask(self) -> Settings: ...

    def tell(self, settings: Settings, score: float) -> None: ...


class OptunaSampler:
    """Optuna's TPE sampler over :class:`SearchSpace`, through its ask/tell interface (no objective
    callback: a sample is measured by training steps between two calls). Optuna (which needs numpy)
    is imported here only, when an ``auto`` tuner is made, never by ``import commsched``."""

    def __init__(self, space: SearchSpace, seed: int = 0) -> None:
        try:
            import optuna
        except ImportError as exc:
            raise ImportError("ordering='auto' tunes with Optuna: pip install optuna==5.0.0 (or "
                              "pip install 'commsched[tuner]'), or choose an ordering yourself "
                              f"(ordering='dynamic'); {exc}") from exc
        self._optuna = optuna
        self._dists = {"ordering": optuna.distributions.CategoricalDistribution(space.orderings),
                       "partition_bytes": optuna.distributions.CategoricalDistribution(space.partitions),
                       "credit_bytes": optuna.distributions.CategoricalDistribution(space.credits),
                       "fusion_bytes": optuna.distributions.CategoricalDistribution(space.fusions),
                       "cross_iteration": optuna.distributions.CategoricalDistribution(space.cross_iterations),
                       "direct_start": optuna.distributions.CategoricalDistribution(space.direct_starts)}
        self._study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=5))
        self._space = space
        self._open: dict[Settings, list[Any]] = {}

    def ask(self) -> Settings:
        trial = self._study.ask(self._dists)
        s = Settings.from_dict(trial.params)
        self._open.setdefault(s, []).append(trial)
        return s

    def tell(self, settings: Settings, score: float) -> None:
        trials = self._open.get(settings)
        if trials:
            self._study.tell(trials.pop(0), score)
        else:  # a setting the tuner chose itself (a start point): a finished trial at its nearest grid point
            params = {k: v for k, v in self._space.nearest(settings).to_dict().items() if k in self._dists}
            self._study.add_trial(self._optuna.trial.create_trial(params=params, distributions=self._dists,
                                                                  value=score))


def location(periods: list[float]) -> float:
    """A setting's score from its step periods: their interquartile mean (the mean of the middle half, a
    quarter dropped at each end), which for one sample of 4 periods is its median. Pooled periods of a
    setting whose steps alternate long and short (the cross-iteration path on balanced, 2026-12-06:
    one setting's 4-step samples at 0.785-0.944 s) have a median that falls anywhere in the gap between
    the two clusters, depending on their extremes; the middle half's mean follows the throughput,
    while a slow step now and then still falls in the dropped quarters."""
    if len(periods) < 4:
        return statistics.median(periods)
    ordered = sorted(periods)
    cut = len(ordered) // 4
    middle = ordered[cut:len(ordered) - cut]
    return sum(middle) / len(middle)


def spread(periods: list[float]) -> float:
    """The noise of a sample's median: half its inter-quartile range, scaled by sqrt(4 / n) for n >= 4
    periods (about one standard error of the median, 0.93 IQR / sqrt(n) for normal periods; at the
    default 4 periods of a sample, half the IQR itself), at least 0.5 % of the median. Periods pooled
    from several samples of one setting thus say more about its median than one sample does."""
    med = statistics.median(periods)
    if len(periods) >= 4:
        q = statistics.quantiles(periods, n=4, method="inclusive")
        half_iqr = (q[2] - q[0]) / 2 * math.sqrt(4 / len(periods))
    else:
        half_iqr = (max(periods) - min(periods)) / 2
    return max(half_iqr, 0.005 * med)


@dataclass
class ModelStarts:
    """What the cost model recommends ``ordering="auto"`` to measure first (:func:`model_starts`)."""

    starts: list[Settings]  # best predicted first
    plans: dict[str, dict]  # digest -> ``Plan.to_dict()`` of each planned start
    notes: list[str]  # one line per recommendation (or why there is none), for the log
    #: where the planner names DDP's engine (communication hidden in the model: ``reducer_buckets``), torch's
    #: reducer with its bucket, for :attr:`Tuner.favoured`; None otherwise
    favoured: Optional[Settings] = None


def model_starts(profile: Any, topology: Any, fusion_bytes: int, *, plan_min_gain: float | None = None,
                 plan_time_limit_s: float = 10.0, default: Settings | None = None,
                 reducer_buckets: tuple[int, ...] = ()) -> ModelStarts:
    """The cost model's start points for the tuner, best predicted first: the advised runtime
    setting (``commsched.costmodel.cli.advise``: ``fifo``, ``dynamic`` with its best piece size
    x credit, or DDP's shape, fifo on the synchronous path with a 1, 4 or 25 MiB fusion threshold;
    ``default``, the config's own settings, unless a candidate is predicted more than the
    model's error ahead of it) and the planner's plan (:func:`commsched.costmodel.planner.make_plan`) where it is
    predicted more than ``plan_min_gain`` ahead of that setting (default the planner's own margin,
    ``PlanSearch.min_gain``: the model's measured error). What only a plan chooses: the two-level
    algorithm per piece, per-tensor sizes, fused groups; on one flat link EDD is already optimal
    and the plan rarely passes. A part that fails (no planner installed, a profile the model
    cannot read) is left out with a note: the model is a head start, never a requirement.

    ``reducer_buckets`` (the driver's where torch's reducer can run; its starts' bucket sizes): the planner
    also weighs DDP's own engine at those sizes (``PlanSearch.reducer_buckets``), and where its plan names
    it (communication hidden in the model, nothing a schedule gains past the margin), no plan is measured
    and ``favoured`` is torch's reducer with that bucket: the tuner's :attr:`Tuner.favoured`."""
    starts: list[Settings] = []
    plans: dict[str, dict] = {}
    notes: list[str] = []
    advised_s = None
    try:
        from commsched.costmodel.cli import advise

        usual = None if default is None else {"ordering": default.ordering, "partition_bytes": default.partition_bytes,
                                              "credit_bytes": default.credit_bytes}
        # no two-level plan in the advice: the planner's own plan is made below
        advice = advise(profile, topology, fusion_bytes=fusion_bytes, default=usual, weigh_plan=False)
        a = advice["settings"]
        advised = Settings(a["ordering"], a.get("partition_bytes", UNLIMITED_BYTES),
                           a.get("credit_bytes", UNLIMITED_BYTES), a.get("fusion_bytes", fusion_bytes),
                           cross_iteration=a.get("cross_iteration", True))
        advised_s = float(advice["commsched_step_s"])
        starts.append(advised)
        kept = " (the config's own: nothing predicted more than the model's error ahead)" \
            if advice.get("kept_default") else ""
        notes.append(f"cost model recommends {advised.describe()} (predicted {advised_s * 1e3:.2f} ms){kept}")
    except Exception as exc:  # noqa: BLE001 - see the docstring
        notes.append(f"no cost-model recommendation ({exc!r})")
    try:
        from commsched.costmodel.planner import PlanSearch, make_plan

        # a plan that names DDP's engine is not measured as a plan: the tuner measures torch's reducer among
        # its own starts, and favours it
        result = make_plan(profile, topology, PlanSearch.for_profile(profile, reducer_buckets=tuple(reducer_buckets)),
                           time_limit_s=plan_time_limit_s)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        notes.append(f"no plan to try ({exc!r})")
        return ModelStarts(starts, plans, notes)
    if result.plan.engine == "reducer":
        favoured = Settings(REDUCER, UNLIMITED_BYTES, UNLIMITED_BYTES, result.plan.bucket_bytes, cross_iteration=False)
        notes.append(f"planner: communication hidden in the model, its plan names DDP's engine: {favoured.describe()} "
                     f"(predicted {result.step_time_s * 1e3:.2f} ms) is the model's pick, favoured in the final race")
        return ModelStarts(starts, plans, notes, favoured)
    against = advised_s if advised_s is not None else float(result.plan.predicted.get("dynamic_step_s", math.inf))
    gain = 1 - result.step_time_s / against if against > 0 else 0.0
    if plan_min_gain is None:
        plan_min_gain = PlanSearch.min_gain
    if gain > plan_min_gain:
        digest = result.plan.digest
        plans[digest] = result.plan.to_dict()
        starts.insert(0, Settings(PLANNED, 0, result.plan.credit_bytes, 0, digest))
        notes.append(f"planner's plan {digest[:12]} predicted {result.step_time_s * 1e3:.2f} ms, {gain:.1%} ahead: "
                     "measured first")
    else:
        notes.append(f"planner's plan predicted {result.step_time_s * 1e3:.2f} ms, {gain:.1%} ahead of the advised "
                     f"setting (not more than {plan_min_gain:.0%}): not tried")
    return ModelStarts(starts, plans, notes)


@dataclass
class Decision:
    """What rank 0 decided at the end of a decision step, for every rank: the settings from step
    ``k + 2`` (None: keep), a plan (``ordering="planned"``, as ``Plan.to_dict()``), the next decision
    step (None: no more), why, or an error every rank raises."""

    settings: Optional[Settings] = None
    next: Optional[int] = None
    reason: str = ""
    plan: Optional[dict] = None
    error: Optional[str] = None

    def encode(self) -> bytes:
        return json.dumps({"settings": self.settings.to_dict() if self.settings else None, "next": self.next,
                           "reason": self.reason, "plan": self.plan, "error": self.error}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Decision":
        d = json.loads(raw.decode())
        return cls(Settings.from_dict(d["settings"]) if d["settings"] else None, d["next"], d["reason"],
                   d["plan"], d["error"])


class AgreedSwitch:
    """The two-phase boundary (module docstring): :meth:`publish` on rank 0 at the end of step ``k``,
    :meth:`take` on every rank at the end of step ``k + 1``.

    ``store``: the ranks' rendezvous store (``set``/``get(key, timeout_s)``); without one (one
    rank, or an engine that negotiates order and has no store) ``broadcast`` (rank 0's object to
    every rank, a collective every rank calls in :meth:`take`) carries the decision."""

    def __init__(self, rank: int, world_size: int, *, store: Any = None, prefix: str = "commsched",
                 timeout_s: float = 300.0, broadcast: Optional[Callable[[Any], Any]] = None) -> None:
        self.rank, self.world_size, self.store, self.prefix = rank, world_size, store, prefix
        self.timeout_s, self.broadcast = timeout_s, broadcast
        self._mine: dict[int, Decision] = {}

    def key(self, step: int) -> str:
        return f"{self.prefix}/switch/{step}"

    def publish(self, step: int, decision: Decision) -> None:
        """Rank 0: the decision made at the end of ``step``."""
        if self.rank != 0:
            raise CommschedError("only rank 0 publishes switch decisions")
        self._mine[step] = decision
        if self.store is not None and self.world_size > 1:
            self.store.set(self.key(step), decision.encode())

    def take(self, step: int) -> Decision:
        """Every rank: the decision of the end of ``step`` (called at the end of ``step + 1``)."""
        if self.rank == 0:
            decision = self._mine.pop(step)
            if self.store is None and self.world_size > 1 and self.broadcast is not None:
                self.broadcast(decision.encode())
            return decision
        if self.store is not None:
            try:
                raw = self.store.get(self.key(step), self.timeout_s)
            except Exception as exc:  # the store's own timeout or a dead rank 0
                raise CommschedTimeout(f"rank {self.rank} waiting for rank 0's settings decision of step {step} "
                                       f"({self.key(step)!r}: {exc!r})", self.timeout_s, []) from exc
            self._forget(step)
            return Decision.decode(raw)
        if self.broadcast is None:
            raise CommschedError("AgreedSwitch needs a store or a broadcast with more than one rank")
        return Decision.decode(self.broadcast(None))

    def _forget(self, step: int) -> None:
        """A follower read the decision of ``step``: the last follower to read it deletes it (and
        the read count), so decisions do not pile up in the store over a long run."""
        add = getattr(self.store, "add", None)
        if add is None:
            return
        try:
            if add(self.key(step) + "/read", 1) >= self.world_size - 1:
                self.store.delete(self.key(step))
                self.store.delete(self.key(step) + "/read")
        except Exception as exc:  # noqa: BLE001 - cleanup only: the decision was read
            log.debug("could not delete the switch decision %r: %r", self.key(step), exc)


@dataclass
class _Sample:
    settings: Settings
    start_step: int
    confirm: bool = False
    recheck: bool = False  # the incumbent measured again before a confirmed winner replaces it
    race: bool = False  # a sample of the final race
    periods: list[float] = field(default_factory=list)


@dataclass
class _Race:
    """The final race of a round: ``queue`` the samples still to run, ``periods`` the race's own
    periods of each setting, ``why`` the reason the search stopped."""

    queue: list[Settings]
    why: str
    periods: dict[Settings, list[float]] = field(default_factory=dict)
    block: list[Settings] = field(default_factory=list)  # one round of the race, repeated by an extension
    extensions: int = 0
    #: the setting kept unless beaten beyond the noise: the model's pick, else the best-scored safe setting
    favoured: Optional[Settings] = None


class Tuner:
    """Online search of :class:`Settings` by measured step period (module docstring). Rank 0 only.

    The driver calls :meth:`first` once (the decision of the first decision step), :meth:`observe`
    with every step's period, and :meth:`decide` at the end of each decision step it was told
    (``Decision.next``); it applies what :meth:`decide` returns from two steps later, on every rank.
    """

    def __init__(self, start: Settings, *, space: SearchSpace | None = None, sampler: Sampler | None = None,
                 extra_starts: tuple[Settings, ...] = (), sample_steps: int = 4, settle: int = 1,
                 max_samples: int = 20, min_gain: float = 0.02, patience: int = 4, drift: float = 0.05,
                 check_every: int = 50, seed: int = 0, remeasure_samples: int = 3, race_samples: int = 0,
                 race_margin: float = 0.05, race_extend: bool = False, race_width: int = 2,
                 favoured: Settings | None = None, safe: tuple[Settings, ...] = (),
                 favour_z: float | None = None) -> None:
        if (sample_steps < 2 or settle < 0 or max_samples < 1 or patience < 1 or check_every < sample_steps
                or remeasure_samples < 1):
            raise ValueError("Tuner: sample_steps >= 2, settle >= 0, max_samples >= 1, patience >= 1, "
                             "check_every >= sample_steps and remeasure_samples >= 1 are required (1: an "
                             "incumbent is never measured again to settle an inconclusive comparison)")
        if race_width < 2:
            raise ValueError(f"Tuner: race_width={race_width}: the final race is between the incumbent and at "
                             "least one runner-up, so race_width >= 2 is required (race_samples=0 turns it off)")
        if race_samples < 0 or max_samples <= race_width * race_samples or not race_margin >= 0:
            raise ValueError(f"Tuner: race_samples={race_samples} and max_samples={max_samples}: the final race "
                             f"takes up to race_width ({race_width}) x race_samples of the max_samples, so 0 <= "
                             f"race_samples < max_samples / {race_width} is required (0 turns the race off), and "
                             f"race_margin={race_margin} must be >= 0")
        if favour_z is not None and (isinstance(favour_z, bool) or not isinstance(favour_z, (int, float))
                                     or not 0 < favour_z < 10):
            raise ValueError(f"Tuner: favour_z={favour_z!r} must be a number of standard errors in (0, 10), e.g. "
                             "1.28 (one-sided 90 %), or None (the larger of the two spreads)")
        self.space = space or SearchSpace()
        starts: list[Settings] = []
        for s in (start, *extra_starts):
            if s not in starts:
                starts.append(s)
        self._starts = starts
        self._make_sampler = (lambda: sampler) if sampler is not None else (
            lambda: OptunaSampler(self.space, seed + self.rounds))
        self.rounds = 0
        self.sampler: Sampler = self._make_sampler()
        self.sample_steps, self.settle, self.max_samples = sample_steps, settle, max_samples
        self.min_gain, self.patience, self.drift, self.check_every = min_gain, patience, drift, check_every
        #: an inconclusive comparison measures the incumbent again while it has fewer samples than this
        self.remeasure_samples = remeasure_samples
        #: the final race (module docstring): fresh samples of the incumbent and of the runner-up, each
        #: this many, alternated; 0: none (the kept score is then the search's own, biased low)
        self.race_samples, self.race_margin = race_samples, race_margin
        #: a race whose two medians are within their noise runs another block of the same samples, while
        #: the round's ``max_samples`` allow (module docstring)
        self.race_extend = bool(race_extend)
        #: the settings in the final race: the incumbent and up to ``race_width - 1`` runners-up within the margin
        self.race_width = race_width
        #: the samples the search may take; the race has the rest of ``max_samples``
        self.search_samples = max_samples - race_width * race_samples
        #: the setting the cost model holds best where it cannot price what separates the candidates (torch's
        #: reducer where communication is hidden in the model): a runner-up of the final race whatever its
        #: search samples scored, and kept there unless another setting's race median beats its own by more
        #: than their noise (module docstring); None: every setting alike
        self.favoured = favoured
        #: where nothing is favoured, the one of these with the lowest search score is, in the final race (the
        #: plugin's: torch's reducer, DDP's engine: commsched's own path must measure faster to replace it)
        self.safe = tuple(safe)
        #: the favoured setting is beaten only by more than this many standard errors of the difference of
        #: the race medians; None: by more than the larger of the two spreads
        self.favour_z = favour_z
        self.phase = "tuning"
        self.incumbent: Optional[Settings] = None
        self.incumbent_score = float("inf")
        self.incumbent_spread = 0.0
        self.samples = 0  # samples of the current tuning round
        self.rounds = 1
        self._confirm_against = (float("inf"), 0.0)
        self._confirm_periods: list[float] = []
        self._incumbent_periods: list[float] = []  # every scored period of the incumbent
        self._recheck: Optional[tuple[Settings, list[float]]] = None  # a confirmed winner, waiting
        self.history: list[dict[str, Any]] = []
        self._current: Optional[_Sample] = None
        self._pending_starts = list(starts)
        self._gains: list[float] = []
        self._settled_periods: list[float] = []
        self._by_setting: dict[Settings, list[float]] = {}  # this round's scored periods of each setting
        self._reference: Optional[tuple[float, float]] = None  # settled: (median, spread) of the first window
        self._race: Optional[_Race] = None
        self._applied: Optional[Settings] = None
        self._bar: Optional[Progress] = None  # samples of the current round, on a terminal

    # ----------------------------------------------------------------- driver API
    def first(self, step: int) -> Decision:
        """The decision at the end of ``step`` (the first decision step): measure the first start."""
        return self._next_sample(step, "start")

    def observe(self, step: int, period_s: float) -> None:
        """The period (seconds) of ``step``, which ran the settings applied last."""
        cur = self._current
        if self.phase == "tuning" and cur is not None and step >= cur.start_step + self.settle:
            cur.periods.append(period_s)
        elif self.phase == "settled":
            self._settled_periods.append(period_s)
            del self._settled_periods[: -self.check_every]

    def decide(self, step: int) -> Decision:
        """The decision at the end of decision step ``step``. One log line says what and why."""
        if self.phase == "settled":
            return self._check_drift(step)
        cur = self._current
        if cur is None or len(cur.periods) < self.sample_steps:  # cannot happen when driven as documented
            missing = 0 if cur is None else self.sample_steps - len(cur.periods)
            return self._log(step, Decision(None, step + max(1, missing), "sample not complete yet"))
        score, noise = location(cur.periods), spread(cur.periods)
        self.samples += 1
        record = {"step": step, "settings": cur.settings.to_dict(), "median_s": score, "spread_s": noise,
                  "periods_s": list(cur.periods), "confirm": cur.confirm, "recheck": cur.recheck}
        if cur.race:
            return self._race_sample(step, cur, record)
        self._by_setting.setdefault(cur.settings, []).extend(cur.periods)
        previous = self.incumbent_score
        if cur.recheck:
            # the incumbent measured a second time: the winner replaces it only if it still wins
            # against both of the incumbent's samples (one unlucky sample cannot lose it)
            winner, won = self._recheck
            self._recheck = None
            pooled = self._incumbent_periods + cur.periods
            inc_score, inc_spread = location(pooled), spread(pooled)
            win_score, win_spread = location(won), spread(won)
            if win_score < inc_score - max(win_spread, inc_spread):
                self._replace_incumbent(winner, won)
                record["verdict"] = "incumbent re-measured: replaced"
            else:
                self.incumbent_score, self.incumbent_spread, self._incumbent_periods = inc_score, inc_spread, pooled
                record["verdict"] = "incumbent re-measured: kept"
        elif cur.confirm:
            # the second measurement of a winner: keep it if it still beats the old incumbent
            kept = score < self._confirm_against[0] - max(noise, self._confirm_against[1])
            both = cur.periods + self._confirm_periods
            if kept and len(self._incumbent_periods) < 2 * self.sample_steps and self.samples < self.search_samples:
                self._recheck = (cur.settings, both)
                record["verdict"] = "confirmed: re-measuring the incumbent"
            elif kept:
                self._replace_incumbent(cur.settings, both)
                record["verdict"] = "confirmed"
            else:
                record["verdict"] = "not confirmed"
        elif self.incumbent is None:
            self._replace_incumbent(cur.settings, cur.periods)
            record["verdict"] = "first incumbent"
        elif cur.settings == self.incumbent:
            # the incumbent measured again (to settle an inconclusive comparison, or the sampler proposed
            # it): its score is the median of all its periods, its noise theirs
            self._replace_incumbent(cur.settings, self._incumbent_periods + cur.periods)
            record["verdict"] = "incumbent measured again: pooled"
        elif score < self.incumbent_score - max(noise, self.incumbent_spread):
            record["verdict"] = "better: confirm"
        elif (score < self.incumbent_score - noise
              and len(self._incumbent_periods) < self.remeasure_samples * self.sample_steps
              and self.samples < self.search_samples):
            # faster by more than its own noise (the branch above: not by the incumbent's, so that is the
            # larger): the incumbent's noisy samples decide, so measure it again (its pooled median is
            # surer) rather than keep it blind
            record["verdict"] = "inconclusive: re-measuring the incumbent"
        else:
            record["verdict"] = "not better"
        if not (cur.confirm or cur.recheck) and self.sampler is not None and \
                cur.settings.ordering in self.space.orderings:
            self.sampler.tell(cur.settings, score)  # a plan is not a point of the sampler's grid
        if cur.recheck or record["verdict"] == "incumbent measured again: pooled":
            score = self.incumbent_score  # what the re-measure changed: the incumbent's score
        gain = (previous - score) / previous if previous < float("inf") else 0.0
        self._gains.append(max(0.0, gain))
        self.history.append(record)
        if record["verdict"] == "confirmed: re-measuring the incumbent":
            return self._next_sample(step, f"{cur.settings.describe()}: confirmed at {score * 1e3:.2f} ms; the "
                                           f"incumbent {self.incumbent.describe()} was measured once: measuring it "
                                           "again before replacing it", recheck=self.incumbent)
        if record["verdict"] == "inconclusive: re-measuring the incumbent":
            return self._next_sample(step, f"{cur.settings.describe()}: median {score * 1e3:.2f} ms beats the "
                                           f"incumbent's {self.incumbent_score * 1e3:.2f} ms by more than its own "
                                           f"noise ({noise * 1e3:.2f} ms), not by the incumbent's "
                                           f"({self.incumbent_spread * 1e3:.2f} ms): measuring the incumbent again",
                                     again=self.incumbent)
        if record["verdict"] == "better: confirm" and self.samples < self.search_samples:
            self._confirm_against = (self.incumbent_score, self.incumbent_spread)
            self._confirm_periods = list(cur.periods)
            return self._next_sample(step, f"{cur.settings.describe()}: median {score * 1e3:.2f} ms beats "
                                           f"{self.incumbent_score * 1e3:.2f} ms by more than the spread; "
                                           "measuring it again", confirm=cur.settings)
        predicted = max(self._gains[-self.patience:]) if len(self._gains) >= self.patience else float("inf")
        if self.samples >= self.search_samples or (not self._pending_starts and predicted < self.min_gain):
            why = (f"{self.samples} samples" if self.samples >= self.search_samples else
                   f"predicted gain {predicted:.1%} < {self.min_gain:.0%} (best of the last {self.patience})")
            if self.race_samples:
                return self._start_race(step, why)
            return self._settle(step, f"stop ({why}): keeping {self.incumbent.describe()} at "
                                      f"{self.incumbent_score * 1e3:.2f} ms")
        return self._next_sample(step, f"{cur.settings.describe()}: median {score * 1e3:.2f} ms "
                                       f"({record['verdict']}); incumbent {self.incumbent.describe()}")

    def close(self) -> None:
        """Remove the progress bar, if one is drawn (idempotent; the driver calls it when it closes)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def stats(self) -> dict[str, Any]:
        """Phase, incumbent and its score, samples, rounds, every sample's record, once settled the median
        period of the first window of the kept setting (what the drift checks compare with), the
        favoured setting (the cost model's pick, or None), the safe settings and ``favour_z``."""
        return {"phase": self.phase, "incumbent": self.incumbent.to_dict() if self.incumbent else None,
                "incumbent_median_s": self.incumbent_score if self.incumbent else None,
                "samples": self.samples, "rounds": self.rounds, "history": list(self.history),
                "settled_reference_s": self._reference[0] if self._reference else None,
                "favoured": self.favoured.to_dict() if self.favoured else None,
                "safe": [x.to_dict() for x in self.safe], "favour_z": self.favour_z}

    # ----------------------------------------------------------------- internals
    def _replace_incumbent(self, settings: Settings, periods: list[float]) -> None:
        self.incumbent, self._incumbent_periods = settings, list(periods)
        self.incumbent_score, self.incumbent_spread = location(periods), spread(periods)

    def _start_race(self, step: int, why: str) -> Decision:
        """The search stopped (``why``): race the incumbent against the runners-up, the other settings of
        this round with the lowest medians over all their periods, up to ``race_width - 1`` of them, each
        within ``race_margin`` of the incumbent's score; each ``race_samples`` fresh samples, in rounds
        whose order reverses from one to the next (runners-up, incumbent, incumbent, runners-up reversed,
        ...: a steady drift of the machine favours none). Without a runner-up that close, the incumbent
        alone is measured afresh: the score the drift checks compare with."""
        inc = self.incumbent
        others = {s: location(p) for s, p in self._by_setting.items() if s != inc and p}
        limit = self.incumbent_score * (1 + self.race_margin)
        runners = [s for s in sorted(others, key=others.get) if others[s] <= limit][: self.race_width - 1]
        fav = self._race_favoured(inc, others)
        if fav is not None and fav != inc and fav in others and fav not in runners:
            # the model's pick (or the safe setting) races whatever its search samples scored (one slow moment
            # must not lose it)
            runners = [fav, *runners][: self.race_width - 1]
        if not runners:
            queue = [inc] * self.race_samples
            what = (f"{why}; no other setting within {self.race_margin:.0%} of {inc.describe()} "
                    f"({self.incumbent_score * 1e3:.2f} ms): measuring it afresh")
        else:
            base = [*runners, inc]
            queue = [x for i in range(self.race_samples) for x in (base if i % 2 == 0 else base[::-1])]
            label = ", the model's pick)" if fav == self.favoured else ", DDP's engine, the safe choice)"
            against = ", ".join(f"{s.describe()} ({others[s] * 1e3:.2f} ms" + (label if s == fav else ")")
                                for s in runners)
            what = (f"{why}; race: {inc.describe()} ({self.incumbent_score * 1e3:.2f} ms) against the runner"
                    f"{'-up' if len(runners) == 1 else 's-up'} {against}, {self.race_samples} fresh samples each")
        self._race = _Race(queue[1:], why, block=queue if runners else [], favoured=fav)
        return self._next_sample(step, what, race=queue[0])

    def _race_sample(self, step: int, cur: _Sample, record: dict[str, Any]) -> Decision:
        """A race sample ended: run the next one, or keep the setting with the lowest median over its race
        periods (fresh: not the smallest of many noisy scores; a tie keeps the incumbent) and settle. With
        ``race_extend``, while the two lowest medians differ by no more than their noise and the round's
        samples allow, those two run another block (the race's own order, the others left out)."""
        race = self._race
        race.periods.setdefault(cur.settings, []).extend(cur.periods)
        record["verdict"] = "race"
        self.history.append(record)
        if race.queue:
            nxt = race.queue.pop(0)
            return self._next_sample(step, f"race: {cur.settings.describe()} median {record['median_s'] * 1e3:.2f} "
                                           "ms", race=nxt)
        # the settings still in the race: an extension's block leaves out all but the two fastest
        medians = {s: location(p) for s, p in race.periods.items() if s in race.block or not race.block}
        if self.race_extend and race.block:
            a, b = sorted(medians, key=lambda s: (medians[s], s != self.incumbent))[:2]
            if self._favoured_holds(race, medians, a) and race.favoured not in (a, b):
                b = race.favoured  # the question is whether the leader beats the favoured one, not the runner-up
            block = [s for s in race.block if s in (a, b)]
            noise = self._margin(race, a, b, favoured=race.favoured in (a, b))
            if abs(medians[a] - medians[b]) <= noise and self.samples + len(block) <= self.max_samples:
                # unresolved: the samples the search left unused decide it
                race.extensions += 1
                race.block, race.queue = block, list(block[1:])
                return self._next_sample(step, f"race: medians {a.describe()} {medians[a] * 1e3:.2f} ms and "
                                               f"{b.describe()} {medians[b] * 1e3:.2f} ms differ by less than their "
                                               f"noise ({noise * 1e3:.2f} ms): {self.race_samples} more samples each",
                                         race=block[0])
        self._race = None
        old, searched = self.incumbent, self.incumbent_score
        kept = min(medians, key=lambda s: (medians[s], s != old))
        favoured_kept = kept != race.favoured and self._favoured_holds(race, medians, kept)
        if favoured_kept:
            kept = race.favoured  # not beaten by more than the noise: the model's pick (or the safe one) stays
        self._replace_incumbent(kept, race.periods[kept])
        self.history.append({"step": step, "verdict": "race: replaced" if kept != old else "race: kept",
                             "settings": kept.to_dict(), "median_s": self.incumbent_score,
                             "spread_s": self.incumbent_spread, "search_median_s": searched,
                             "race_medians_s": {s.describe(): m for s, m in medians.items()},
                             "race_extensions": race.extensions, "favoured_kept": favoured_kept,
                             "race_favoured": race.favoured.to_dict() if race.favoured else None})
        against = "; ".join(f"{s.describe()} {m * 1e3:.2f} ms" for s, m in medians.items())
        outcome = (f"keeping {kept.describe()}" if kept == old else
                   f"the runner-up {kept.describe()} replaces {old.describe()}")
        if favoured_kept:
            outcome += (" (the model's pick" if race.favoured == self.favoured else " (DDP's engine, the safe choice") \
                + ", not beaten by more than the noise)"
        return self._settle(step, f"stop ({race.why}): race medians {against}: {outcome}, kept at "
                                  f"{self.incumbent_score * 1e3:.2f} ms (the search's score {searched * 1e3:.2f} ms)")

    def _favoured_holds(self, race: _Race, medians: dict[Settings, float], leader: Settings) -> bool:
        """Whether the race's favoured setting is still in it (``medians``) and ``leader``'s race median beats
        its own by no more than :meth:`_margin`."""
        fav = race.favoured
        if fav is None or fav not in medians:
            return False
        return medians[fav] - medians[leader] <= self._margin(race, fav, leader)

    def _margin(self, race: _Race, a: Settings, b: Settings, favoured: bool = True) -> float:
        """How far one of ``a``, ``b`` must lead the other in the race to be ahead beyond the noise: where one of
        them is the favoured one, ``favour_z`` standard errors of the difference of their race medians (each
        median's :func:`spread`); else, or without ``favour_z``, the larger of the two spreads."""
        sa, sb = spread(race.periods[a]), spread(race.periods[b])
        return self.favour_z * math.hypot(sa, sb) if favoured and self.favour_z is not None else max(sa, sb)

    def _race_favoured(self, inc: Settings, others: dict[Settings, float]) -> Optional[Settings]:
        """The setting the final race keeps unless beaten beyond the noise: the model's pick, else the safe
        setting with the lowest score in this round's search (the incumbent's its own), else None."""
        if self.favoured is not None:
            return self.favoured
        scores = {s: v for s, v in others.items() if s in self.safe}
        if inc in self.safe:
            scores[inc] = self.incumbent_score
        return min(scores, key=lambda s: (scores[s], s != inc)) if scores else None

    def _next_sample(self, step: int, why: str, confirm: Settings | None = None,
                     recheck: Settings | None = None, again: Settings | None = None,
                     race: Settings | None = None) -> Decision:
        if race is not None:
            settings = race
        elif recheck is not None:
            settings = recheck
        elif again is not None:
            settings = again
        elif confirm is not None:
            settings = confirm
        elif self._pending_starts:
            settings = self._pending_starts.pop(0)
        else:
            settings = self.sampler.ask()
        apply_at = step + 2
        self._current = _Sample(settings, apply_at, confirm is not None, recheck is not None, race is not None)
        decision = Decision(settings if settings != self._applied else None,
                            apply_at + self.settle + self.sample_steps - 1, why)
        self._applied = settings
        if self._bar is None:
            self._bar = Progress("tuner", self.max_samples)
        self._bar.update(self.samples, description=f"commsched tuner, round {self.rounds}: sample {self.samples + 1} "
                                                   f"{settings.describe()}" + (" (race)" if race else " (again)"
                                                                               if confirm or recheck or again else ""))
        return self._log(step, decision, f"sample {self.samples + 1}: {settings.describe()}")

    def _settle(self, step: int, why: str) -> Decision:
        self.phase = "settled"
        self._settled_periods, self._reference = [], None
        apply = self.incumbent if self.incumbent != self._applied else None
        self._applied = self.incumbent
        self._current = None
        if self._bar is not None:
            self._bar.update(self.samples, description=f"commsched tuner, round {self.rounds}: kept "
                                                       f"{self.incumbent.describe()} after {self.samples} samples")
            self.close()
        return self._log(step, Decision(apply, step + 2 + self.check_every, why))

    def _check_drift(self, step: int) -> Decision:
        if len(self._settled_periods) < self.sample_steps:
            return self._log(step, Decision(None, step + self.check_every, "settled: too few steps to check"))
        window, self._settled_periods = self._settled_periods, []  # the next check judges the steps after this
        now = statistics.median(window)
        if self._reference is None:
            # the first window of the kept setting is what later windows are compared with: up to check_every
            # periods, surer than the few of the samples that scored it (and not the smallest of noisy scores)
            self._reference = (now, spread(window))
            return self._log(step, Decision(None, step + self.check_every, f"settled: {now * 1e3:.2f} ms over "
                                            f"{len(window)} steps (scored {self.incumbent_score * 1e3:.2f} ms): the "
                                            f"reference of the drift checks"))
        reference, reference_spread = self._reference
        moved = now / reference - 1
        noise = max(spread(window), reference_spread)
        if abs(moved) <= self.drift or abs(now - reference) <= 2 * noise:  # within the noise: keep
            return Decision(None, step + self.check_every, f"settled: {moved:+.1%}")  # not logged: no change
        # re-tune from the incumbent: a fresh search whose first sample is the incumbent itself
        self.phase, self.rounds, self.samples, self._gains = "tuning", self.rounds + 1, 0, []
        self._starts = [self.incumbent] + [s for s in self._starts if s != self.incumbent]
        self._pending_starts = list(self._starts)
        self.incumbent, self.incumbent_score, self.incumbent_spread = None, float("inf"), 0.0
        self._incumbent_periods, self._recheck = [], None
        self._by_setting, self._race = {}, None
        self.sampler = self._make_sampler()
        self.history.append({"step": step, "verdict": "drift", "median_s": now, "moved": moved})
        return self._next_sample(step, f"step time drifted {moved:+.1%} (> {self.drift:.0%}): re-tuning")

    def _log(self, step: int, decision: Decision, what: str | None = None) -> Decision:
        change = decision.settings.describe() if decision.settings else "keep"
        log.info("tuner step %d: %s -> %s; next decision at step %s (%s)", step, what or decision.reason, change,
                 decision.next, decision.reason)
        return decision
