"""``DistributedOptimizer``: a Keras optimizer whose gradient all-reduce commsched schedules.

The wrapper is a dynamic subclass of the user's optimizer class, rebuilt from its
config (as Horovod does), so every update rule is Keras's own. It overrides one
method: the hook Keras calls, in the replica context, to all-reduce the gradients
before it applies them.

* Keras 3 (``keras>=3``, TensorFlow backend): ``_all_reduce_sum_gradients``, called
  by ``TFOptimizer._backend_update_step``. It is a private hook, so the wrapper
  checks at construction that the installed Keras still calls it (tested with
  keras 3.15.1; :data:`TESTED_KERAS`).
* tf-keras (``TF_USE_LEGACY_KERAS=1``): the public ``aggregate_gradients``.

What it guarantees:

* the gradients are summed across workers exactly once: the override replaces
  the stock all-reduce (never runs after it), and gradients already reduced by a
  commsched :class:`~commsched.plugins.tensorflow.DistributedGradientTape` pass
  through untouched;
* ``apply_gradients`` runs once per step as usual, so ``iterations`` advances by
  one per step (Adam's bias correction stays right);
* each variable's update depends only on its own reduced pieces, so it fires as
  soon as they land (the graph's dataflow does this; nothing waits for the rest).

Keras 3 ``model.fit`` under ``MultiWorkerMirroredStrategy`` is broken upstream
(keras-team/keras#20585): with Keras 3 use a custom loop (``strategy.run`` of a
step that calls ``opt.apply_gradients``); ``model.fit`` works with tf-keras.
"""

from __future__ import annotations

import inspect
from typing import Any

from commsched.config import SchedulerConfig
from commsched.plugins.tensorflow.reduction import GradientReducer

__all__ = ["DistributedOptimizer", "TESTED_KERAS"]

#: Keras 3 version whose private ``_all_reduce_sum_gradients`` hook this wrapper was tested with.
TESTED_KERAS = "3.15.1"

_classes: dict[type, type] = {}


def DistributedOptimizer(optimizer: Any, config: SchedulerConfig | None = None, *,  # noqa: N802 (Horovod's name)
                         backend: str = "collective", measure: bool = True) -> Any:
    """Wrap a Keras optimizer so that commsched schedules its gradient all-reduce.

    Args:
        optimizer: a Keras 3 optimizer (TensorFlow backend) or a tf-keras optimizer
            (``tf_keras.optimizers.*``, not ``.legacy``), not used yet. Create the
            wrapper inside ``strategy.scope()``.
        config: partition, credit and ordering (default: ``SchedulerConfig()``, i.e.
            from ``COMMSCHED_*`` or the defaults). Must be the same on every worker.
        backend: ``"collective"`` (TF collective ops, default) or ``"horovod"``.
        measure: the graph stamps each piece's times for ``report()`` (default); False
            writes no stamps (steps, bytes and pieces are still counted).

    Returns an optimizer of a subclass of ``type(optimizer)``, with the same
    configuration, that sums gradients across workers with commsched. It is a
    context manager; ``close()`` (or leaving the ``with`` block) makes later
    ``apply_gradients`` traces raise :class:`commsched.SchedulerClosed`.
    ``opt.commsched`` is the :class:`~commsched.plugins.tensorflow.reduction.GradientReducer`
    (its ``plans``, ``slots`` and ``config``).
    """
    family = _family(type(optimizer))
    if _is_built(optimizer):
        raise ValueError(
            "DistributedOptimizer needs a fresh optimizer: this one already has state (it has been used or "
            "built). Wrap it before the first step, e.g. DistributedOptimizer(tf.keras.optimizers.Adam(1e-3))")
    reducer = GradientReducer(config, backend=backend, op="sum", measure=measure)
    cls = _distributed_class(type(optimizer), family)
    wrapped = cls.from_config(optimizer.get_config())
    wrapped.commsched = reducer
    return wrapped


def _family(cls: type) -> str:
    roots = {c.__module__.split(".")[0] for c in inspect.getmro(cls)}
    if "tf_keras" in roots:
        if hasattr(cls, "aggregate_gradients"):
            return "tf_keras"
        raise TypeError(
            f"{cls.__name__} is a legacy tf-keras optimizer (tf_keras.optimizers.legacy); commsched wraps the "
            "current ones: use tf_keras.optimizers.SGD/Adam/... instead")
    if "keras" in roots:
        if not _keras3_calls_hook(cls):
            import keras

            raise TypeError(
                f"commsched's DistributedOptimizer hooks Keras 3's TFOptimizer._all_reduce_sum_gradients, which "
                f"keras {keras.__version__} does not call (tested with {TESTED_KERAS}); with another Keras backend "
                "than TensorFlow, or another Keras version, use DistributedGradientTape in a custom loop instead")
        return "keras3"
    raise TypeError(
        f"DistributedOptimizer expects a Keras optimizer (keras.optimizers.* or tf_keras.optimizers.*), got "
        f"{cls.__module__}.{cls.__name__}")


def _keras3_calls_hook(cls: type) -> bool:
    step = getattr(cls, "_backend_update_step", None)
    if getattr(cls, "_all_reduce_sum_gradients", None) is None:
        return False
    try:
        return step is not None and "_all_reduce_sum_gradients" in inspect.getsource(step)
    except (OSError, TypeError):  # no source (zipped install): trust the attribute
        return True


def _is_built(optimizer: Any) -> bool:
    # Keras 3: `built`; tf-keras: `_built` (both set when slot variables are created).
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


def _distributed_class(base: type, family: str) -> type:
    cls = _classes.get(base)
    if cls is None:
        hook = _Keras3Hook if family == "keras3" else _TfKerasHook
        namespace = {k: v for c in (_Lifecycle, hook) for k, v in vars(c).items()
                     if k not in ("__dict__", "__weakref__")}
        namespace["__module__"] = base.__module__
        namespace["__qualname__"] = base.__qualname__
        namespace["__doc__"] = (base.__doc__ or "") + "\n\n(Gradient all-reduce scheduled by commsched.)"
        cls = _classes[base] = type(base.__name__, (base,), namespace)
    return cls


class _Lifecycle:
    """Methods both subclasses have: ``close()`` and the context manager."""

    def close(self) -> None:
        """Refuse further gradient reductions (:class:`commsched.SchedulerClosed`). Idempotent."""
        self.commsched.close()

    def report(self, topology=None) -> str:
        """A short summary of the steps so far: bytes and pieces per step, and as measured in
        the graph communication time, exposed communication, effective bandwidth; the
        settings in use; with ``topology`` the cost model's expectation. See
        :meth:`commsched.plugins.tensorflow.reduction.GradientReducer.report`."""
        return self.commsched.report(topology)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _Keras3Hook(_Lifecycle):
    """Methods of the Keras 3 subclass."""

    def _all_reduce_sum_gradients(self, grads_and_vars):  # Keras 3 TFOptimizer hook
        return self.commsched.reduce_grads_and_vars(grads_and_vars)


class _TfKerasHook(_Lifecycle):
    """Methods of the tf-keras subclass."""

    def aggregate_gradients(self, grads_and_vars):  # tf-keras public hook
        return self.commsched.reduce_grads_and_vars(grads_and_vars)
