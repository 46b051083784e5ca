"""The scheduled reduction of one step's gradients, written into the step's graph.

``GradientReducer.reduce(grads, names)`` is what the optimizer wrapper and the
gradient tape call, at trace time, in the replica context:

1. **partition**: each gradient is cut with the core's ``piece_bounds``
   (``partition_bytes``), exactly as the live scheduler would cut it;
2. **order**: :func:`commsched.replay.plan` replays the core's priority-and-credit
   queue on a model of the backward pass (gradients listed in forward order;
   backward produces the last first; priority = position in that list). The
   result depends only on shapes, dtypes and the config, so every worker writes
   the same order into its graph. ``ordering="fifo"`` plans by ready order;
   ``"dynamic"`` and ``"static"`` both plan by priority (a graph cannot consult
   rank 0 at run time, so the order is fixed at trace time either way);
3. **credit**: ``K = max(1, credit_bytes // partition_bytes)`` slots; the backend
   chains each slot's pieces, so at most ``K`` pieces (≤ ``credit_bytes``) are in
   flight, and a piece starts as soon as its gradient exists and its slot is free;
4. **reassemble**: the reduced pieces of a gradient are concatenated and
   reshaped. Nothing else depends on them, so each variable's update (emitted
   by the optimizer after this returns) fires as soon as its own pieces land.

With ``ordering="planned"`` (a :class:`commsched.plan.Plan`, ``config.plan``) steps 1-3
come from the plan: before the first reduction every worker checks the plan against
its gradients (names as :func:`variable_name` gives them, shapes, dtypes) and the world
size, and agrees on its digest with the others (:mod:`commsched.plan_agreement`, over
the backend's ``all_gather_object``): a mismatch anywhere is a ``PlanMismatch`` on every
worker. Then each plan group (one gradient, or several small ones concatenated into one
flat buffer and split again after the reduction) is cut at its own piece size and the
pieces are written in the plan's order (the replay drives ``PlannedPolicy``), on
``max(1, credit_bytes // largest piece)`` slots. Pieces planned ``"hierarchical"`` run as
ring all-reduces (TF collective ops here have no two-level algorithm; a warning says so).

Gradients returned here are remembered (weakly) as *reduced*: the optimizer
wrapper passes them through untouched, which is what makes
``DistributedGradientTape`` + ``DistributedOptimizer`` safe from a double reduction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
import weakref
from typing import Any, Iterable, Iterator, Sequence

import tensorflow as tf

from commsched.config import SchedulerConfig, check_config, check_layer_priority
from commsched.errors import SchedulerClosed
from commsched.plan import Plan as CommPlan
from commsched.plan import PlanMismatch, PlannedTensor, fused_name
from commsched.plan_agreement import agree_on_plan, check_plan, note_engine
from commsched.replay import (
    CostModel,
    Plan,
    PlannedPiece,
    PlanTensor,
    backward_ready_times,
    graph_lookahead_s,
    plan,
)
from commsched.plugins.tensorflow import failures, watchdog
from commsched.plugins.tensorflow.backends import ReplicaGroup, make_backend, replica_group
from commsched.plugins.tensorflow.measure import Recorder, stamp
from commsched.plugins.tensorflow.stats import TraceRecord, format_report, observed_readiness, reduction_stats
from commsched.plugins.tensorflow.tensor_ops import check_gradient, dense, join_pieces
from commsched.timeline import Timeline

__all__ = ["GradientReducer", "OPS", "fusion_groups", "is_reduced", "mark_reduced", "planned_tensor", "process_report",
           "slots_for", "variable_name"]

log = logging.getLogger(__name__)

OPS = ("sum", "mean")

_reduced: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_reduced_lock = threading.Lock()
# Every traced reduction of the process (the newest 64), for the process-wide report(): a
# tape's reducer lives only as long as its trace, its measurements as long as the graph runs.
_records: list[TraceRecord] = []
_records_lock = threading.Lock()
#: reducers with ordering="static" whose newest trace planned from the model, not from an observation:
#: :func:`commsched.plugins.tensorflow.function` traces its step again once (see :func:`static_pending`)
_static_pending: "weakref.WeakSet[GradientReducer]" = weakref.WeakSet()
#: the sets of :func:`tracing_into` now open: a static reducer that traces joins each
_static_collectors: "list[weakref.WeakSet[GradientReducer]]" = []
_static_lock = threading.Lock()


def static_pending(reducers: "Iterable[GradientReducer] | None" = None) -> bool:
    """True while some open reducer with ``ordering="static"`` (of ``reducers``; None: of the process)
    traced only from the model: a new trace would plan it from the order its graph measured
    (``GradientReducer._observation``)."""
    with _static_lock:
        pool = _static_pending if reducers is None else [r for r in reducers if r in _static_pending]
        return any(not r.closed for r in pool)


@contextlib.contextmanager
def tracing_into(reducers: "weakref.WeakSet[GradientReducer]") -> Iterator[None]:
    """While open, every static reducer that traces (on any thread: a distribution strategy traces its
    replica function on threads of its own) is added to ``reducers``: what a compiled step's
    graph holds, so that :class:`~.functions.CompiledStep` traces again only for its own."""
    with _static_lock:
        _static_collectors.append(reducers)
    try:
        yield
    finally:
        with _static_lock:  # by identity: WeakSets compare by their members
            del _static_collectors[next(i for i, c in enumerate(_static_collectors) if c is reducers)]


_timelines: dict[str, tuple[Timeline, list[float]]] = {}  # path -> (timeline, [end of the last plan, us])
_timelines_lock = threading.Lock()
# Plans every worker agreed on, by (plan source, this run's gradients, world size): the agreement
# is a collective, made once per process and plan, so a retrace or a new tape per trace on one
# worker (which the others may not do) never waits for the others.
_agreed: dict[tuple, CommPlan] = {}
_agreed_lock = threading.Lock()


class _TracedPlanMismatch(PlanMismatch):
    """A :class:`~commsched.plan.PlanMismatch` that stays one when raised while a ``tf.function``
    is traced: AutoGraph re-creates such an error with its own message only if the class
    takes ``Exception``'s constructor, and turns any other into a ``StagingError``."""

    __init__ = Exception.__init__


def mark_reduced(tensor: Any) -> None:
    """Remember that ``tensor`` is already reduced across workers (weakly)."""
    with _reduced_lock:
        _reduced[id(tensor)] = tensor


def is_reduced(tensor: Any) -> bool:
    """True for a tensor returned by a commsched reduction (so it must not be reduced again)."""
    with _reduced_lock:
        return _reduced.get(id(tensor)) is tensor


def slots_for(config: SchedulerConfig) -> int:
    """The number of ordering chains: ``credit_bytes // partition_bytes``, at least 1."""
    return max(1, config.credit_bytes // config.partition_bytes)


class GradientReducer:
    """Reduces one step's gradients in pieces, in planned order, within the credit.

    Args:
        config: the :class:`~commsched.config.SchedulerConfig` (default: from the environment).
        backend: ``"collective"`` (TF collective ops) or ``"horovod"``.
        op: ``"sum"`` or ``"mean"`` across replicas.

        measure: stamp each piece's times in the graph for :meth:`report` (default; a few tens of
            microseconds per piece); False counts steps, bytes and pieces only.

    ``plans`` keeps the plan of every trace (the newest last), for inspection.
    After :meth:`close`, :meth:`reduce` raises :class:`commsched.SchedulerClosed`
    (a ``tf.function`` traced before keeps the reduction ops it already holds).
    """

    def __init__(self, config: SchedulerConfig | None = None, backend: str = "collective", op: str = "sum",
                 measure: bool = True) -> None:
        check_config(config)
        if not isinstance(measure, bool):
            raise TypeError(f"measure must be True or False, got {measure!r}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str ('collective' or 'horovod'), got {type(backend).__name__}")
        if op not in OPS:
            raise ValueError(f"op={op!r}: use 'sum' or 'mean'")
        self.config = config if config is not None else SchedulerConfig()
        check_layer_priority(self.config, "TensorFlow")
        self.backend = make_backend(backend, self.config.timeout_s)
        self.op = op
        #: whether the graph stamps its pieces (:mod:`.measure`; False: no stamps, report() times unmeasured)
        self.measure = measure
        self.slots = slots_for(self.config)
        self.plans: list[Plan] = []
        #: :class:`~commsched.plugins.tensorflow.stats.TraceRecord` of every trace (the newest 8 last):
        #: its plan and what the graph measured of its pieces
        self.records: list[TraceRecord] = []
        self._world = 1
        #: with ``ordering="planned"``: the :class:`commsched.plan.Plan` every worker agreed on (None before)
        self.plan: CommPlan | None = None
        self.closed = False
        self._traces = 0
        #: ordering="static": what the newest trace planned from ("model", or "observed": step 2 of docs/tensorflow.md)
        self._planned_from = "model"
        if self.config.ordering == "planned":
            if self.config.plan is None:
                raise ValueError("ordering='planned' on TensorFlow needs a plan: SchedulerConfig(ordering='planned', "
                                 "plan='plan.json') (make one with `commsched plan --profile P --topology T --json "
                                 "plan.json`); planning in-process from the first steps is not supported here")
            if self.backend.name != "collective":
                raise ValueError(f"ordering='planned' on TensorFlow runs on backend='collective' (TF collective ops), "
                                 f"not {self.backend.name!r}; with Horovod use ordering='dynamic'")

    def close(self) -> None:
        """Refuse further reductions; the last open reducer stops the process's watchdog
        thread (:mod:`.watchdog`). Idempotent."""
        self.closed = True
        watchdog.release(self)

    # ------------------------------------------------------------------ API
    def reduce(self, grads: Sequence[Any], names: Sequence[str] | None = None) -> list[Any]:
        """Return ``grads`` reduced across replicas (``None`` stays ``None``).

        ``grads`` must be listed in forward-use order (as ``model.trainable_variables``
        lists them): that order is the priority. Gradients already reduced by
        commsched pass through unchanged. In a cross-replica context, or with a
        single replica, nothing is communicated.
        """
        if self.closed:
            raise SchedulerClosed("this commsched optimizer or tape is closed; wrap a new one to train further")
        grads = list(grads)
        names = list(names) if names is not None else [variable_name(None, i) for i in range(len(grads))]
        if len(names) != len(grads):
            raise ValueError(f"got {len(grads)} gradients but {len(names)} names")
        group = self._group()
        if group is None:
            return grads
        todo = [i for i, g in enumerate(grads) if g is not None and not is_reduced(g)]
        if not todo:
            return grads
        planned = None
        if self.config.ordering == "planned":
            absent = [names[i] for i, g in enumerate(grads) if g is None]
            planned = self._agree(grads, names, todo, absent, group)
        if group.size == 1 and self.backend.name == "collective":
            # Nothing to communicate; a mean over one replica is the gradient itself.
            out = list(grads)
            for i in todo:
                out[i] = tf.identity(dense(grads[i]))
                mark_reduced(out[i])
            return out
        values = []
        for i in todo:
            value = dense(grads[i])
            check_gradient(names[i], value)
            values.append(value)
        self._world = group.size
        try:
            if planned is not None:
                reduced = self._reduce_planned(values, [names[i] for i in todo], group, planned)
            else:
                reduced = self._reduce_dense(values, [names[i] for i in todo], group)
        except tf.errors.OpError as exc:  # eagerly, a piece failed right here
            failures.raise_translated(exc)
        out = list(grads)
        for i, value in zip(todo, reduced, strict=True):
            out[i] = value
            mark_reduced(value)
        return out

    def settings(self) -> dict[str, Any]:
        """The settings in use: ordering, piece size, credit, ordering chains, fusion threshold, backend, op, timeout
        (and the plan's digest under ``ordering="planned"``; under ``"static"``, ``planned_from``: ``"model"``
        or ``"observed (<n> runs)"``, what the newest trace planned from)."""
        out: dict[str, Any] = {"ordering": self.config.ordering, "partition_bytes": self.config.partition_bytes,
                               "credit_bytes": self.config.credit_bytes, "slots": self.slots,
                               "fusion_bytes": self._fusion_bytes(),
                               "backend": self.backend.name, "op": self.op, "timeout_s": self.config.timeout_s}
        if not self.measure:
            out["measure"] = False
        if self.plan is not None:
            out["plan"] = self.plan.digest[:12]
        if self.config.ordering == "static":
            out["planned_from"] = self._planned_from
        return out

    def stats(self) -> dict[str, Any]:
        """What the graph measured of this reducer's steps (one step = one run of one traced
        reduction): ``steps``, ``bytes_per_step``, ``pieces_per_step``, and over the kept runs
        ``comm_s``, ``exposed_comm_s``, ``compute_s``, ``effective_bandwidth_bytes_s``,
        ``overlap_ratio`` (None where nothing was measured). See :mod:`.stats`."""
        return dict(reduction_stats(self.records), settings=self.settings())

    def report(self, topology: Any = None) -> str:
        """A short summary of this reducer's steps so far (:meth:`stats` as text, the settings in use);
        with ``topology`` (a :class:`commsched.costmodel.Topology`, e.g. from ``commsched probe``)
        also what the network should take for these bytes and the simulator's expected step."""
        return format_report(self.records, dict(self.settings(), world_size=self._world), topology)

    def reduce_grads_and_vars(self, grads_and_vars: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        """:meth:`reduce` for ``(gradient, variable)`` pairs, naming pieces after the variables."""
        pairs = list(grads_and_vars)
        names = [variable_name(v, i) for i, (_, v) in enumerate(pairs)]
        reduced = self.reduce([g for g, _ in pairs], names)
        return [(g, v) for g, (_, v) in zip(reduced, pairs, strict=True)]

    # ------------------------------------------------------------ internals
    def _group(self) -> ReplicaGroup | None:
        if self.backend.name == "horovod":
            return self.backend.group()
        return replica_group()

    def _fusion_bytes(self) -> int:
        """The fusion threshold in use: ``fusion_bytes``, at most ``partition_bytes`` (a fused piece is
        never larger than a piece); 0 under ``planned`` (the plan's groups) and on Horovod, which fuses
        what it receives in one cycle itself (measured: small gradients off the chains there ran 0.93x
        Horovod against 0.96x on them, 7 alternating pairs; docs/tensorflow.md)."""
        if self.config.ordering == "planned" or self.backend.negotiates_order:
            return 0
        return min(self.config.fusion_bytes, self.config.partition_bytes)

    def _reduce_dense(self, values: list[tf.Tensor], names: list[str], group: ReplicaGroup) -> list[tf.Tensor]:
        """Large gradients: cut, ordered by the replay, on the slots' chains. Small ones (each under
        :meth:`_fusion_bytes`; none on Horovod): concatenated into fusion groups
        (:func:`fusion_groups`), one piece each, off the chains (slot ``-1 - g``, a token of its
        own): each goes as soon as its members exist and never holds up a large piece. The credit
        counts the large pieces only; the small ones add at most the sum of the small gradients
        to the bytes in flight."""
        sizes = [int(v.shape.num_elements()) * v.dtype.size for v in values]
        ready = backward_ready_times(sizes)
        observed = self._observation(names, group)
        if self._observes():
            self._planned_from = "model" if observed is None else f"observed ({observed['runs']} runs)"
            with _static_lock:
                (_static_pending.add if observed is None else _static_pending.discard)(self)
                for reducers in _static_collectors:
                    reducers.add(self)
        cost, graph = None, {}
        if observed is not None:  # static, traced again: the order and link rate the graph measured
            ready = [observed["ready"][n] for n in names]
            cost = CostModel(link_bytes_per_s=observed["link_bytes_per_s"])
            graph = {"shared_link": True, "lookahead_s": graph_lookahead_s(self.config.credit_bytes, cost)}
        fused = fusion_groups(sizes, [v.dtype for v in values], self._fusion_bytes())
        small = {i for g in fused for i in g}
        large = [i for i in range(len(values)) if i not in small]
        tensors = [PlanTensor(name=names[i], numel=int(values[i].shape.num_elements()),
                              element_size=values[i].dtype.size, priority=i, ready=ready[i]) for i in large]
        schedule = plan(tensors, self.config.partition_bytes, self.config.credit_bytes, slots=self.slots,
                        ordering=self.config.ordering, cost=cost, **graph)
        flats = [tf.reshape(values[i], [-1]) for i in large]
        free = []
        for g, members in enumerate(fused):
            flats.append(_concat_flat(values, members))
            nbytes = sum(sizes[i] for i in members)
            at = max(ready[i] for i in members)
            free.append(PlannedPiece(tensor=len(large) + g, index=0, name=_group_name([names[i] for i in members]),
                                     start=0, stop=nbytes // values[members[0]].dtype.size, nbytes=nbytes,
                                     priority=min(members), seq=len(large) + g, slot=-1 - g, ready=at,
                                     issue=at, finish=at + nbytes / CostModel().link_bytes_per_s))
        if free:
            schedule = dataclasses.replace(schedule, pieces=schedule.pieces + tuple(free))
        members = [(names[i],) for i in large] + [tuple(names[i] for i in g) for g in fused]
        pieces = self._issue(schedule, flats, group, members)
        out: list[tf.Tensor] = list(values)
        for i, p in zip(large, pieces[:len(large)], strict=True):
            out[i] = join_pieces(p, values[i]) if p else values[i]
        for members, p in zip(fused, pieces[len(large):], strict=True):
            _split_into(out, p[0], values, members)
        return out

    def _reduce_planned(self, values: list[tf.Tensor], names: list[str], group: ReplicaGroup,
                        commplan: CommPlan) -> list[tf.Tensor]:
        """The plan's groups, cut at their piece sizes, in the plan's order; a fused group is one
        flat buffer (``tf.concat`` of its members) reduced in pieces, then split back."""
        where = {name: k for k, name in enumerate(names)}
        ready = backward_ready_times([int(v.shape.num_elements()) * v.dtype.size for v in values])
        members = [[where[t] for t in g.tensors] for g in commplan.groups]
        tensors = [PlanTensor(name=g.name, numel=commplan.group_numel(g), element_size=commplan.group_element_size(g),
                              priority=min(m), ready=max(ready[i] for i in m))
                   for g, m in zip(commplan.groups, members, strict=True)]
        schedule = plan(tensors, self.config.partition_bytes, commplan.credit_bytes, slots=self.slots,
                        ordering="planned", plan=commplan)
        flats = [_concat_flat(values, m) for m in members]
        pieces = self._issue(schedule, flats, group, [tuple(names[i] for i in m) for m in members])
        out: list[tf.Tensor | None] = [None] * len(values)
        for m, flat, reduced in zip(members, flats, pieces, strict=True):
            joined = reduced[0] if len(reduced) == 1 else tf.concat(reduced, axis=0) if reduced else flat
            _split_into(out, joined, values, m)
        return out

    def _observes(self) -> bool:
        """Whether traces of this reducer plan from observations (``static``, measured, TF collective ops,
        traced: not eagerly)."""
        return (self.config.ordering == "static" and self.measure and not self.backend.negotiates_order
                and not tf.executing_eagerly())

    @tf.autograph.experimental.do_not_convert  # eager reads of the stamps while a step is traced
    def _observation(self, names: list[str], group: ReplicaGroup) -> dict[str, Any] | None:
        """``ordering="static"``: what an earlier trace of these gradients measured
        (:func:`~commsched.plugins.tensorflow.stats.observed_readiness`), or None (the first trace,
        and always on Horovod: there, planned so, the step ran 0.90x plain Horovod against 1.00x
        as ``dynamic``; docs/tensorflow.md, step 2). Every worker plans from worker 0's observation
        (an eager all-gather at trace time): the plan's order is the collectives' instance keys.
        Eagerly nothing is observed: there every step plans anew, and pieces run one after another."""
        if not self._observes():
            return None
        mine = observed_readiness(self.records, names)
        if group.size > 1:
            mine = self.backend.all_gather_object(mine, group, what="the order it observed (ordering='static')")[0]
        return mine

    def _issue(self, schedule: Plan, flats: list[tf.Tensor], group: ReplicaGroup,
               members: list[tuple[str, ...]]) -> list[list[tf.Tensor]]:
        """Write one reduction per piece of ``schedule`` (over ``flats[piece.tensor]``, which holds the
        gradients ``members[piece.tensor]``), in its order, on its slots; returns each flat tensor's
        reduced pieces in element order."""
        self.plans.append(schedule)
        del self.plans[:-8]
        keys_start = self.backend.reserve(len(schedule.pieces))
        recorder = self._recorder(schedule, group, members) if schedule.pieces else None
        timed = self.measure and recorder is not None
        if recorder is not None and self.backend.name == "collective" and group.size > 1:
            # TF's own collective timeouts cost a sleeping thread each: the process's watchdog
            # bounds the reduction instead, from its first gradient on (see watchdog.py)
            recorder.begin(flats[schedule.pieces[0].tensor])
            watchdog.watch(_watched, self)
        pieces: list[list[tf.Tensor | None]] = [[None] * len(p) for p in schedule.by_tensor(len(flats))]
        last_on_slot: dict[int, tf.Tensor] = {}
        start = stamp() if timed else None
        ready, done = [], []
        eager = tf.executing_eagerly()
        for k, piece in enumerate(schedule.pieces):
            flat = flats[piece.tensor]
            whole = piece.start == 0 and piece.stop == int(flat.shape.num_elements())
            part = flat if whole else flat[piece.start:piece.stop]
            previous = last_on_slot.get(piece.slot)
            if timed:
                ready.append(stamp(part))
            # the collective waits for the stamp of its own data (taken once that data exists, so
            # no new order between pieces): ready <= issue <= done holds whatever the executor does
            with tf.control_dependencies(ready[-1:] if timed and not eager else []):
                try:
                    result = self.backend.reduce(part, group=group, slot=piece.slot, keys_start=keys_start,
                                                 index=k, name=piece.name, op=self.op, previous=previous)
                except tf.errors.OpError as exc:
                    if not eager:
                        raise
                    raise failures.piece_error(exc, piece.name, group.rank, self.config.timeout_s) from exc
            if not eager:
                failures.register_op(result.op.name, piece.name, group.rank, self.config.timeout_s)
            if timed:
                done.append(stamp(result))
            last_on_slot[piece.slot] = result
            pieces[piece.tensor][piece.index] = result
        if timed:
            recorder.record(start, ready, done)
        elif recorder is not None:
            recorder.count_only([r for chain in pieces for r in chain if r is not None])
        self._record(schedule, group)
        return pieces

    def _recorder(self, schedule: Plan, group: ReplicaGroup, members: list[tuple[str, ...]]) -> Recorder:
        """The recorder of this plan: one per distinct plan (an eager step, a retrace or an unrolled
        step with the same plan share it, so eager training does not make one per step)."""
        key = (tuple(schedule.order), tuple(p.slot for p in schedule.pieces), group.size)
        for record in self.records:
            if record.key == key:
                return record.recorder
        record = TraceRecord(schedule, Recorder([p.slot for p in schedule.pieces]),
                             dict(self.settings(), world_size=group.size, rank=group.rank), key, tuple(members))
        self.records.append(record)
        del self.records[:-8]
        with _records_lock:
            _records.append(record)
            del _records[:-64]
        return record.recorder

    def _agree(self, grads: list[Any], names: list[str], todo: list[int], absent: list[str],
               group: ReplicaGroup) -> CommPlan:
        """``ordering="planned"``: the plan, checked against these gradients and the world and agreed
        on by every worker (once per process, plan and model); ``PlanMismatch`` on every worker else."""
        source = self.config.plan
        entries = tuple(planned_tensor(names[i], dense(grads[i])) for i in todo)
        key = (source.digest if isinstance(source, CommPlan) else source, entries, group.size)
        with _agreed_lock:
            agreed = _agreed.get(key)
        if agreed is None:
            found: CommPlan | BaseException
            if absent:
                found = ValueError(f"variables {absent[:5]} have no gradient (None) in this step; ordering='planned' "
                                   "reduces every planned gradient every step (drop them from the sources and the "
                                   "plan, or use ordering='dynamic')")
            else:
                try:
                    found = check_plan(source, entries, group.size)
                except (ValueError, OSError) as exc:  # PlanMismatch is a ValueError too
                    found = exc
            gather = None
            if group.size > 1:
                def gather(mine: dict) -> list[dict]:
                    return self.backend.all_gather_object(mine, group)
            try:
                agreed = agree_on_plan(found, rank=group.rank, world_size=group.size, gather=gather,
                                       source=source if isinstance(source, str) else None)
            except PlanMismatch as exc:
                raise _TracedPlanMismatch(str(exc)) from exc
            note_engine(agreed, "TensorFlow has no DDP reducer")
            hierarchical = sum(p.algorithm == "hierarchical" for p in agreed.pieces)
            if hierarchical:
                log.warning("the plan (digest %s) has %d piece(s) planned 'hierarchical'; TensorFlow's collective ops "
                            "have no two-level all-reduce here, so they run as ring all-reduces (order and piece "
                            "sizes as planned; the two-level algorithm's gain is not there)",
                            agreed.digest[:12], hierarchical)
            with _agreed_lock:
                _agreed[key] = agreed
        if self.plan is not agreed:
            self.plan = agreed
            self.config = dataclasses.replace(self.config, plan=agreed, credit_bytes=agreed.credit_bytes)
            largest = max((agreed.piece_bytes(p) for p in agreed.pieces), default=1)
            self.slots = max(1, agreed.credit_bytes // max(1, largest))
        return agreed

    def _record(self, schedule: Plan, group: ReplicaGroup) -> None:
        """Append the plan to the Chrome-trace timeline: modelled times, one trace after another.

        Every reducer of the process writing to one path shares one timeline, so the
        file shows every planned reduction in the order they were traced.
        """
        self._traces += 1
        path = self.config.timeline
        if path is None:
            return
        with _timelines_lock:
            if path not in _timelines:
                _timelines[path] = (Timeline(path, group.rank, group.size), [0.0])
            timeline, end = _timelines[path]
            start_us = end[0]
            end[0] = start_us + schedule.makespan * 1e6 + 1000.0
        for k, p in enumerate(schedule.pieces):
            args = dict(slot=p.slot, bytes=p.nbytes, order=k, trace=self._traces, slots=self.slots, planned=True)
            timeline.span("QUEUED", p.name, start_us + p.ready * 1e6, start_us + p.issue * 1e6, **args)
            timeline.span("COMM", p.name, start_us + p.issue * 1e6, start_us + p.finish * 1e6, **args)
        try:
            timeline.write()
        except OSError as exc:
            log.warning("could not write the commsched timeline to %s: %s", timeline.path, exc)


def _watched() -> list[TraceRecord]:
    """The reductions the watchdog reads: every one traced over TF collective ops and several workers."""
    with _records_lock:
        return [r for r in _records
                if r.settings.get("backend") == "collective" and r.settings.get("world_size", 1) > 1]


def fusion_groups(sizes: Sequence[int], dtypes: Sequence[Any], fusion_bytes: int) -> list[list[int]]:
    """The fusion groups of gradients listed in forward order with byte ``sizes``: every gradient
    smaller than ``fusion_bytes`` (and not empty) joins one, walking in backward order (the order
    backward makes them, so a group waits for few late members), one dtype per group, at most
    ``fusion_bytes`` together; members in forward order. ``fusion_bytes`` 0: none. Unlike the
    PyTorch plugin's runs of *adjacent* small tensors, a group here skips over large gradients
    between its members: in a graph every piece is one collective and one chain link, and the
    small ones (biases, norms) sit between large kernels."""
    groups: list[list[int]] = []
    open_by_dtype: dict[Any, tuple[list[int], int]] = {}
    if fusion_bytes <= 0:
        return groups
    for i in range(len(sizes) - 1, -1, -1):
        if not 0 < sizes[i] < fusion_bytes:
            continue
        members, total = open_by_dtype.get(dtypes[i], (None, 0))
        if members is None or total + sizes[i] > fusion_bytes:
            members, total = [], 0
            groups.append(members)
        members.append(i)
        open_by_dtype[dtypes[i]] = (members, total + sizes[i])
    return [sorted(g) for g in groups]


def _concat_flat(values: list[tf.Tensor], members: list[int]) -> tf.Tensor:
    """``values[members]`` flattened into one buffer, in order (a lone member: just flattened)."""
    if len(members) == 1:
        return tf.reshape(values[members[0]], [-1])
    return tf.concat([tf.reshape(values[i], [-1]) for i in members], axis=0)


def _split_into(out: list, flat: tf.Tensor, values: list[tf.Tensor], members: list[int]) -> None:
    """The inverse of :func:`_concat_flat`: ``out[i]`` for each member, shaped as ``values[i]``."""
    parts = [flat] if len(members) == 1 else tf.split(flat, [int(values[i].shape.num_elements()) for i in members])
    for i, part in zip(members, parts, strict=True):
        out[i] = tf.reshape(part, values[i].shape)


def _group_name(names: list[str]) -> str:
    """A fusion group's piece name, as the scheduler names pieces (``<task>#<index>``)."""
    return f"{names[0] if len(names) == 1 else fused_name(names)}#0"


def process_report(topology: Any = None) -> str:
    """:meth:`GradientReducer.report` over every reduction this process traced (the newest 64),
    whichever optimizer or tape made it: a tape's reducer is gone after its trace, its
    measurements are not. Settings are those of the newest trace."""
    with _records_lock:
        records = list(_records)
    settings = records[-1].settings if records else {}
    return format_report(records, settings, topology)


def planned_tensor(name: str, tensor: Any) -> PlannedTensor:
    """The plan's entry (:class:`commsched.plan.PlannedTensor`) for a gradient or variable called
    ``name``: element count, element size, shape and dtype name (``"float32"``, as torch's)."""
    dtype = tf.as_dtype(tensor.dtype)
    shape = tf.TensorShape(tensor.shape)
    if not shape.is_fully_defined():
        raise ValueError(f"variable {name!r} has a gradient of unknown shape {shape}; ordering='planned' needs static "
                         "shapes (build the model with a fixed input shape before the first step)")
    dims = tuple(int(d) for d in shape)
    return PlannedTensor(name, int(shape.num_elements()), int(dtype.size), dims, dtype.name)


def variable_name(variable: Any, index: int) -> str:
    """The name of the ``index``-th gradient's pieces: ``"<index>:<variable path or name>"``
    (``"grad<index>"`` for a variable without either), without TensorFlow's output suffix
    (``":0"``), so that a Keras 3 variable (``path``, seen by the tape) and the ``tf.Variable``
    inside it (``name``, seen by the optimizer's hook) get one name, the one a plan uses.
    The index keeps names unique when two variables share a name; the name makes
    timelines readable."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None)
    if isinstance(name, str):
        name = re.sub(r":\d+$", "", name)
    return f"{index}:{name}" if name else f"grad{index}"
