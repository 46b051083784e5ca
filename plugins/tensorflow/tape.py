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

from typing import Any

import tensorflow as tf

from commsched.config import SchedulerConfig
from commsched.plugins.tensorflow.reduction import GradientReducer, variable_name

__all__ = ["DistributedGradientTape"]

_classes: dict[type, type] = {}


def DistributedGradientTape(tape: tf.GradientTape, config: SchedulerConfig | None = None, *,  # noqa: N802
                            backend: str = "collective", op: str = "mean") -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` after its ``with`` block (as in Horovod).

    Args:
        tape: the tape that recorded the forward pass.
        config: partition, credit and ordering (default ``SchedulerConfig()``); the
            same on every worker.
        backend: ``"collective"`` (TF collective ops, default) or ``"horovod"``.
        op: ``"mean"`` (default: gradients averaged over workers, for a loss that is
            each worker's own mean) or ``"sum"`` (for a loss already divided by the
            global batch size, as ``tf.nn.compute_average_loss`` does).

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
    reducer = GradientReducer(config, backend=backend, op=op)
    cls = _classes.get(type(tape))
    if cls is None:
        cls = _classes[type(tape)] = _tape_class(type(tape))
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(tape.__dict__)  # the same recording: GradientTape keeps it in attributes
    wrapped.commsched = reducer
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
        names = [variable_name(s, i) for i, s in enumerate(tf.nest.flatten(sources))]
        return tf.nest.pack_sequence_as(grads, self.commsched.reduce(flat, names))

    def close(self: Any) -> None:
        """Refuse further ``gradient()`` calls (:class:`commsched.SchedulerClosed`). Idempotent."""
        self.commsched.close()

    return type(base.__name__, (base,), {"__module__": __name__, "__doc__": __doc__, "gradient": gradient,
                                         "close": close})
