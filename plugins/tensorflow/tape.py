"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` returns
gradients already reduced (averaged by default) across workers, in scheduled pieces.

Use it in a custom loop, inside ``strategy.run``::

    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(loss_fn(y, model(x)))        # this worker's mean loss
    tape = DistributedGradientTape(tape, config=config)
    grads = tape.gradient(loss, model.trainable_variables)  # the mean over workers

The gradients are final: apply them **without a second reduction**. Three ways:

* a commsched :func:`~commsched.plugins.tensorflow.DistributedOptimizer` (Keras 3
  or tf-keras): it recognises gradients reduced by commsched and passes them
  through, so ``opt.apply_gradients(zip(grads, variables))`` is right;
* a plain tf-keras optimizer: ``opt.apply_gradients(..., skip_gradients_aggregation=True)``;
* your own update (``variable.assign_sub(lr * grad)``).

A *plain Keras 3 optimizer* inside ``strategy.run`` would all-reduce them again
(Keras 3 has no switch to skip it): wrap it with ``DistributedOptimizer``.
"""

from __future__ import annotations

import sys
from typing import Any

import tensorflow as tf

from commsched.config import SchedulerConfig
from commsched.plugins.tensorflow.reduction import GradientReducer, variable_name

__all__ = ["DistributedGradientTape"]

_classes: dict[type, type] = {}


def _horovod_tensorflow() -> Any:
    """``horovod.tensorflow`` if the user's script imported it (never imported here)."""
    return sys.modules.get("horovod.tensorflow")


def resolve_backend(backend: str) -> str:
    """``"auto"`` is ``"horovod"`` when ``horovod.tensorflow`` is imported and initialized
    (a ``horovodrun`` script), else ``"collective"``; other names are themselves."""
    if backend != "auto":
        return backend
    hvd = _horovod_tensorflow()
    try:
        return "horovod" if hvd is not None and hvd.is_initialized() else "collective"
    except Exception:  # a half-imported Horovod is not "initialized"
        return "collective"


def _reduce_op(op: Any) -> str:
    """``"mean"`` or ``"sum"`` for ``op``: those words, or Horovod's ``hvd.Average``/``hvd.Sum``."""
    if isinstance(op, str):
        return {"average": "mean"}.get(op.lower(), op.lower())
    hvd = _horovod_tensorflow()
    if hvd is not None and not isinstance(op, bool):
        if op == hvd.Average:
            return "mean"
        if op == hvd.Sum:
            return "sum"
    raise ValueError(f"op={op!r} is not supported; use op=hvd.Average ('mean', the default) or op=hvd.Sum ('sum')")


def DistributedGradientTape(tape: tf.GradientTape, config: SchedulerConfig | None = None, *,  # noqa: N802
                            backend: str = "auto", op: Any = "mean", compression: Any = None,
                            device_dense: str = "", device_sparse: str = "", sparse_as_dense: bool = False,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                            process_set: Any = None, scale_local_gradients: bool = True,
                            measure: bool = True) -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` after its ``with`` block (as in Horovod).

    A drop-in for ``hvd.DistributedGradientTape(tape, compression=...)``: it takes
    Horovod's arguments, and under ``horovodrun`` (``horovod.tensorflow`` initialized)
    ``backend="auto"`` reduces with Horovod. It works on Keras 3 variables, where
    Horovod 0.28.1's own tape fails.

    Args:
        tape: the tape that recorded the forward pass.
        config: partition, credit and ordering (default ``SchedulerConfig()``); the
            same on every worker.
        backend: ``"auto"`` (default: Horovod when ``horovod.tensorflow`` is
            initialized, else TF collective ops), ``"collective"`` or ``"horovod"``.
        op: ``"mean"``/``hvd.Average`` (default: gradients averaged over workers, for
            a loss that is each worker's own mean) or ``"sum"``/``hvd.Sum`` (for a loss
            already divided by the global batch size, as ``tf.nn.compute_average_loss`` does).
        compression: Horovod's; only ``hvd.Compression.none`` (or None).
        sparse_as_dense: Horovod's: ``tf.IndexedSlices`` gradients become dense tensors.
        device_dense, device_sparse, gradient_predivide_factor, num_groups, groups,
            process_set, scale_local_gradients: Horovod's; only their defaults are
            accepted (anything else raises ``ValueError`` naming it).
        measure: the graph stamps each piece's times for ``report()`` (default); False
            writes no stamps (steps, bytes and pieces are still counted).

    Returns a tape of a subclass of ``type(tape)`` sharing its recorded state.
    ``gradient(target, sources)`` lists ``sources`` in forward-use order for the best
    schedule (``model.trainable_variables`` does). ``close()`` makes later
    ``gradient()`` calls raise :class:`commsched.SchedulerClosed`; the tape's ``with``
    block stays ``tf.GradientTape``'s (it records; ``gradient()`` comes after it).
    ``tape.commsched`` is the :class:`~commsched.plugins.tensorflow.reduction.GradientReducer`
    (its ``plans``, ``slots`` and ``config``).
    """
    if not isinstance(tape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}; "
                        "use: with tf.GradientTape() as tape: ...; tape = DistributedGradientTape(tape)")
    if isinstance(config, str):  # hvd.DistributedGradientTape(tape, device_dense, ...)
        device_dense, config = config, None
    if compression is not None and getattr(compression, "__name__", type(compression).__name__) != "NoneCompressor":
        raise ValueError(f"compression={getattr(compression, '__name__', compression)} is not supported: commsched "
                         "reduces gradients in their own dtype. Drop compression= (or pass hvd.Compression.none)")
    unsupported = {"device_dense": (device_dense, ""), "device_sparse": (device_sparse, ""),
                   "gradient_predivide_factor": (gradient_predivide_factor, 1.0), "num_groups": (num_groups, 0),
                   "groups": (groups, None), "scale_local_gradients": (scale_local_gradients, True)}
    for name, (value, default) in unsupported.items():
        if value != default:
            raise ValueError(f"{name}={value!r} is not supported by commsched's DistributedGradientTape (it places "
                             f"and groups pieces itself); drop {name}=")
    if process_set is not None and getattr(process_set, "process_set_id", None) != 0:
        raise ValueError("process_set: commsched reduces over all workers (the global process set); drop process_set=")
    reducer = GradientReducer(config, backend=resolve_backend(backend), op=_reduce_op(op), measure=measure)
    cls = _classes.get(type(tape))
    if cls is None:
        cls = _classes[type(tape)] = _tape_class(type(tape))
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(tape.__dict__)  # the same recording: GradientTape keeps it in attributes
    wrapped.commsched = reducer
    wrapped.sparse_as_dense = bool(sparse_as_dense)
    return wrapped


def _tape_class(base: type) -> type:
    """The subclass of ``base`` whose ``gradient`` reduces; it calls ``base.gradient``
    by name (not ``super(type(self), self)``, which recurses forever in a subclass)."""

    def gradient(self: Any, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE) -> Any:
        """Gradients of ``target`` w.r.t. ``sources``, reduced across workers (see the module docstring)."""
        if self.commsched.closed:
            self.commsched.reduce([], [])  # raises SchedulerClosed, before the tape is consumed
        grads = base.gradient(self, target, sources, output_gradients=output_gradients,
                              unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads)
        if self.sparse_as_dense:
            flat = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in flat]
        names = [variable_name(s, i) for i, s in enumerate(tf.nest.flatten(sources))]
        return tf.nest.pack_sequence_as(grads, self.commsched.reduce(flat, names))

    def close(self: Any) -> None:
        """Refuse further ``gradient()`` calls (:class:`commsched.SchedulerClosed`). Idempotent."""
        self.commsched.close()

    def report(self: Any, topology: Any = None) -> str:
        """This tape's reductions so far (see ``GradientReducer.report``); a tape made inside a
        traced step lives as long as its trace: ``commsched.plugins.tensorflow.report()`` covers
        every reduction of the process."""
        return self.commsched.report(topology)

    # declared here: sparse_as_dense (Horovod's argument) says whether IndexedSlices become dense
    return type(base.__name__, (base,), {"__module__": __name__, "__doc__": __doc__, "gradient": gradient,
                                         "close": close, "report": report, "sparse_as_dense": False})
