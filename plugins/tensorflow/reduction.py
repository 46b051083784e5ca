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

Gradients returned here are remembered (weakly) as *reduced*: the optimizer
wrapper passes them through untouched, which is what makes
``DistributedGradientTape`` + ``DistributedOptimizer`` safe from a double reduction.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Sequence

import tensorflow as tf

from commsched.config import SchedulerConfig, check_config
from commsched.errors import SchedulerClosed
from commsched.replay import Plan, PlanTensor, backward_ready_times, plan
from commsched.plugins.tensorflow.backends import ReplicaGroup, make_backend, replica_group
from commsched.plugins.tensorflow.tensor_ops import check_gradient, dense, join_pieces
from commsched.timeline import Timeline

__all__ = ["GradientReducer", "OPS", "is_reduced", "mark_reduced", "slots_for", "variable_name"]

log = logging.getLogger(__name__)

OPS = ("sum", "mean")

_reduced: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_reduced_lock = threading.Lock()
_timelines: dict[str, tuple[Timeline, list[float]]] = {}  # path -> (timeline, [end of the last plan, us])
_timelines_lock = threading.Lock()


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

    ``plans`` keeps the plan of every trace (the newest last), for inspection.
    After :meth:`close`, :meth:`reduce` raises :class:`commsched.SchedulerClosed`
    (a ``tf.function`` traced before keeps the reduction ops it already holds).
    """

    def __init__(self, config: SchedulerConfig | None = None, backend: str = "collective", op: str = "sum") -> None:
        check_config(config)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str ('collective' or 'horovod'), got {type(backend).__name__}")
        if op not in OPS:
            raise ValueError(f"op={op!r}: use 'sum' or 'mean'")
        self.config = config if config is not None else SchedulerConfig()
        self.backend = make_backend(backend, self.config.timeout_s)
        self.op = op
        self.slots = slots_for(self.config)
        self.plans: list[Plan] = []
        self.closed = False
        self._traces = 0

    def close(self) -> None:
        """Refuse further reductions. Idempotent. (TF's collectives hold no thread or
        connection of commsched's that would outlive the step.)"""
        self.closed = True

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
        reduced = self._reduce_dense(values, [names[i] for i in todo], group)
        out = list(grads)
        for i, value in zip(todo, reduced, strict=True):
            out[i] = value
            mark_reduced(value)
        return out

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

    def _reduce_dense(self, values: list[tf.Tensor], names: list[str], group: ReplicaGroup) -> list[tf.Tensor]:
        sizes = [int(v.shape.num_elements()) * v.dtype.size for v in values]
        ready = backward_ready_times(sizes)
        tensors = [PlanTensor(name=names[i], numel=int(v.shape.num_elements()), element_size=v.dtype.size,
                              priority=i, ready=ready[i]) for i, v in enumerate(values)]
        schedule = plan(tensors, self.config.partition_bytes, self.config.credit_bytes, slots=self.slots,
                        ordering=self.config.ordering)
        self.plans.append(schedule)
        del self.plans[:-8]
        keys_start = self.backend.reserve(len(schedule.pieces))
        flats = [tf.reshape(v, [-1]) for v in values]
        pieces: list[list[tf.Tensor | None]] = [[None] * len(p) for p in schedule.by_tensor(len(values))]
        last_on_slot: dict[int, tf.Tensor] = {}
        for k, piece in enumerate(schedule.pieces):
            value = values[piece.tensor]
            flat = flats[piece.tensor]
            whole = piece.start == 0 and piece.stop == int(value.shape.num_elements())
            part = flat if whole else flat[piece.start:piece.stop]
            result = self.backend.reduce(part, group=group, slot=piece.slot, keys_start=keys_start, index=k,
                                         name=piece.name, op=self.op, previous=last_on_slot.get(piece.slot))
            last_on_slot[piece.slot] = result
            pieces[piece.tensor][piece.index] = result
        self._record(schedule, group)
        return [join_pieces(p, v) if p else v for p, v in zip(pieces, values, strict=True)]

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


def variable_name(variable: Any, index: int) -> str:
    """The name of the ``index``-th gradient's pieces: ``"<index>:<variable path or name>"``
    (``"grad<index>"`` for a variable without either). The index keeps names unique
    when two variables share a name; the name makes timelines readable."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None)
    return f"{index}:{name}" if name else f"grad{index}"
