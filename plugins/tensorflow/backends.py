"""Collective engines for TensorFlow: TF collective ops (default) and Horovod.

A backend turns one planned piece into one reduction op. It is called at trace
time, in the plan's issue order, and must make the graph respect that order on
each of the plan's slots (chains):

* :class:`CollectiveBackend` uses ``tf.raw_ops.CollectiveReduceV2`` with one
  *ordering token* per slot. TensorFlow's automatic control dependencies
  serialize the ops that share a token, in creation order, and leave ops on
  different tokens free; so ``K`` tokens make a window of at most ``K`` pieces in
  flight, and each piece starts as soon as its gradient exists and its
  predecessor on the slot has finished. (Without tokens every collective is
  chained to every other stateful op: one piece at a time, and a ``tf.print``
  changes the schedule.)
* :class:`HorovodBackend` uses ``horovod.tensorflow.allreduce``; Horovod matches
  tensors across ranks by name, and an explicit control dependency per slot keeps
  the window.

:meth:`CollectiveBackend.all_gather_object` exchanges a small JSON-able object between
the workers, eagerly, once before the first step (``ordering="planned"`` compares the
plan's digest with it: :func:`commsched.plan_agreement.agree_on_plan`).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import tensorflow as tf

from commsched.errors import CommschedTimeout, HorovodUnavailable
from commsched.plugins.tensorflow import keys
from commsched.plugins.tensorflow.failures import TracedTimeout

__all__ = ["BACKENDS", "CollectiveBackend", "HorovodBackend", "ReplicaGroup", "make_backend",
           "replica_group"]

BACKENDS = ("collective", "horovod")

_FINAL_OP = {"sum": "Id", "mean": "Div"}


class ReplicaGroup:
    """Who takes part in a reduction: ``size`` replicas, this one on ``device`` as ``rank``."""

    __slots__ = ("size", "rank", "device")

    def __init__(self, size: int, rank: int, device: str | None) -> None:
        self.size = size
        self.rank = rank
        self.device = device

    def __repr__(self) -> str:
        return f"ReplicaGroup(size={self.size}, rank={self.rank}, device={self.device!r})"


def replica_group() -> ReplicaGroup | None:
    """The group of the current replica context, or None in a cross-replica context.

    Supports one replica per worker (``MultiWorkerMirroredStrategy`` on CPU or one
    GPU per worker) and the default (single-replica) strategy.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        return None
    strategy = ctx.strategy
    size = int(ctx.num_replicas_in_sync)
    if size == 1:
        return ReplicaGroup(1, 0, None)
    extended = strategy.extended
    devices = tuple(getattr(extended, "worker_devices", ()))
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or len(devices) != 1:
        raise ValueError(
            f"commsched's TensorFlow plugin reduces over one replica per worker, but {type(strategy).__name__} "
            f"runs {size} replicas on {len(devices) or 'several'} local device(s). Use "
            "tf.distribute.MultiWorkerMirroredStrategy with one device per worker (one process per GPU, e.g. "
            "CUDA_VISIBLE_DEVICES per worker)")
    resolver = getattr(strategy, "cluster_resolver", None)
    rank = int(getattr(resolver, "task_id", 0) or 0)
    return ReplicaGroup(size, rank, devices[0])


class CollectiveBackend:
    """TF collective ops (``CollectiveReduceV2``) ordered by one token per slot.

    Instance keys come from :mod:`commsched.plugins.tensorflow.keys` (unique per
    call, identical on every worker). The pieces carry no TF timeout: TensorFlow runs each
    collective's timeout on a sleeping thread of its own (so ``pieces per second x
    timeout_s`` threads alive), and commsched's watchdog bounds each reduction by
    ``timeout_s`` with one thread per process instead
    (:mod:`commsched.plugins.tensorflow.watchdog`). A dead peer surfaces at once as
    ``tf.errors.UnavailableError``; a silent one when the watchdog aborts the collectives
    (``DeadlineExceededError``, once, so TensorFlow's abort path never runs twice at a time).
    The one-off plan check (:meth:`all_gather_object`) keeps TF's own timeout.
    """

    name = "collective"
    negotiates_order = False

    def __init__(self, timeout_s: float, communication_hint: str = "auto") -> None:
        self.timeout_s = float(timeout_s)
        self.communication_hint = communication_hint

    def reserve(self, n: int) -> Any:
        """Draw instance keys for the ``n`` pieces of one reduction (see :mod:`.keys`)."""
        return keys.reserve(n)

    def reduce(self, piece: tf.Tensor, *, group: ReplicaGroup, slot: int, keys_start: Any, index: int, name: str,
               op: str, previous: tf.Tensor | None = None) -> tf.Tensor:
        """Sum (``op="sum"``) or average (``"mean"``) ``piece`` over ``group``, on token ``slot``;
        ``index`` is the piece's position in the plan (its instance key is ``keys_start + index``)."""
        instance_key = keys.instance_key(keys_start, index)
        with tf.device(group.device):
            token = ordering_token(group.device, slot)
            return tf.raw_ops.CollectiveReduceV2(
                input=piece, group_size=group.size, group_key=keys.GROUP_KEY, instance_key=instance_key,
                ordering_token=[token], merge_op="Add", final_op=_FINAL_OP[op],
                communication_hint=self.communication_hint,
                timeout_seconds=0.0,  # bounded by the watchdog: a TF timeout costs a thread per collective
                name="commsched_" + _op_name(name))


    def all_gather_object(self, obj: Any, group: ReplicaGroup, what: str = "its plan check") -> list[Any]:
        """Every worker's ``obj`` (JSON-able), by rank, on every worker; run eagerly (also when
        called while a ``tf.function`` is traced: it leaves the graph with ``tf.init_scope``).

        Two collectives on commsched's group: the longest encoding (``Max``), then a sum of
        one row per rank, each zero but the sender's. Each waits at most ``timeout_s``; a
        worker that never joins (dead, or not running the same code) is a
        :class:`~commsched.errors.CommschedTimeout`.
        """
        data = json.dumps(obj, sort_keys=True).encode()
        if group.size == 1:
            return [json.loads(data)]
        with tf.init_scope(), tf.device(group.device):
            start = keys.reserve(2)
            try:
                longest = self._eager_reduce(tf.constant([len(data)], tf.int32), group, start, 0, "Max")
                rows = np.zeros((group.size, int(longest.numpy()[0]) + 1), np.int32)
                rows[group.rank, 0] = len(data)
                rows[group.rank, 1:1 + len(data)] = np.frombuffer(data, np.uint8)
                rows = self._eager_reduce(tf.constant(rows), group, start, 1, "Add").numpy()
            except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError, tf.errors.CancelledError) as exc:
                # TracedTimeout: raised while a tf.function traces, it reaches the user as itself
                # (a plain CommschedTimeout would become AutoGraph's StagingError)
                error = CommschedTimeout(f"worker {group.rank} exchanging {what} with the other workers (does "
                                         "every worker run the same ordering, and is it alive?) "
                                         f"[{type(exc).__name__}]", self.timeout_s)
                raise TracedTimeout.of(error) from exc
        return [json.loads(bytes(row[1:1 + row[0]].astype(np.uint8).tobytes()).decode()) for row in rows]

    def _eager_reduce(self, value: tf.Tensor, group: ReplicaGroup, start: Any, k: int, merge: str) -> tf.Tensor:
        return tf.raw_ops.CollectiveReduceV2(
            input=value, group_size=group.size, group_key=keys.GROUP_KEY, instance_key=keys.instance_key(start, k),
            ordering_token=[], merge_op=merge, final_op="Id", communication_hint=self.communication_hint,
            timeout_seconds=self.timeout_s, name="commsched_plan_check")


class HorovodBackend:
    """``horovod.tensorflow.allreduce`` per piece; Horovod agrees on order by tensor name.

    Needs a Horovod wheel built with TensorFlow (``HOROVOD_WITH_TENSORFLOW=1``; in the
    commsched repository ``make horovod``) and ``hvd.init()`` before the first step;
    run under ``horovodrun`` without a ``tf.distribute`` strategy. Without Horovod,
    construction raises :class:`commsched.errors.HorovodUnavailable`.
    """

    name = "horovod"
    negotiates_order = True

    def __init__(self, timeout_s: float) -> None:
        try:
            import horovod.tensorflow as hvd
        except ImportError as exc:
            raise HorovodUnavailable(
                "backend='horovod' needs horovod.tensorflow, a Horovod wheel built with TensorFlow support; in the "
                "commsched repository `make horovod` builds one, elsewhere install Horovod with "
                f"HOROVOD_WITH_TENSORFLOW=1 (or use backend='collective'). Import failed: {exc}") from exc
        self._hvd = hvd
        self.timeout_s = float(timeout_s)

    def group(self) -> ReplicaGroup:
        hvd = self._hvd
        try:
            return ReplicaGroup(int(hvd.size()), int(hvd.rank()), None)
        except ValueError as exc:
            raise ValueError("backend='horovod': call horovod.tensorflow.init() before the first step") from exc

    def reserve(self, n: int) -> Any:
        return None  # Horovod names its tensors; no instance keys

    def reduce(self, piece: tf.Tensor, *, group: ReplicaGroup, slot: int, keys_start: Any, index: int, name: str,
               op: str, previous: tf.Tensor | None = None) -> tf.Tensor:
        hvd = self._hvd
        hvd_op = hvd.Average if op == "mean" else hvd.Sum
        deps = [previous] if previous is not None and not tf.executing_eagerly() else []
        with tf.control_dependencies(deps):
            return hvd.allreduce(piece, op=hvd_op, name="commsched." + _op_name(name))


def make_backend(name: str, timeout_s: float) -> CollectiveBackend | HorovodBackend:
    """The backend called ``name`` (one of :data:`BACKENDS`)."""
    if name == "collective":
        return CollectiveBackend(timeout_s)
    if name == "horovod":
        return HorovodBackend(timeout_s)
    raise ValueError(f"backend={name!r} is not a TensorFlow backend; use one of {', '.join(BACKENDS)}")


_tokens: dict[tuple[str | None, int], tf.Tensor] = {}
_tokens_lock = threading.Lock()


def ordering_token(device: str | None, slot: int) -> tf.Tensor:
    """The resource handle that orders slot ``slot`` on ``device`` (shared by every reduction
    of the process, so that the window holds across optimizers and tapes).

    It is a handle only (no variable is created): collectives never read it, and
    created eagerly it enters functions as a capture, free of any control edge.
    """
    key = (device, slot)
    with _tokens_lock:
        token = _tokens.get(key)
        if token is None:
            with tf.init_scope(), tf.device(device):
                token = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name=f"commsched_token_{slot}")
            _tokens[key] = token
        return token


def _op_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return cleaned.lstrip("._-") or "piece"
