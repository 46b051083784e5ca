"""Public helpers: ``unroll`` (several training steps in one ``tf.function``, for
cross-iteration overlap) and ``plan_model`` (the model as a plan names it).

Separate ``tf.function`` calls cannot overlap: each call returns only when all of
its ops finished, so step t+1's forward cannot start while step t's last
reductions are still in flight. Unrolled into one graph, the only thing step
t+1's layer ``i`` waits for is the update of layer ``i``'s own variables (the
graph orders reads of a variable after its last write, and nothing else), so
the next forward starts while later layers still communicate. The result is
the same training, bit for bit: the ops are the same, only their overlap changes.

``ordering="planned"`` checks a plan against the gradients by the names commsched
gives them (``"<index>:<variable path>"``, see ``reduction.variable_name``);
:func:`plan_model` lists a model's variables under those names, to make a plan by hand
or to see what a plan made elsewhere must call them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import tensorflow as tf

from commsched.plan import PlannedTensor
from commsched.plugins.tensorflow.reduction import planned_tensor, variable_name

__all__ = ["plan_model", "unroll"]


def plan_model(variables: Iterable[Any]) -> list[PlannedTensor]:
    """The plan's model entries for ``variables`` (pass ``model.trainable_variables``, in that
    order, as the optimizer and the tape see them): the names ``ordering="planned"`` checks
    a plan against, with element count, element size, shape and dtype."""
    return [planned_tensor(variable_name(v, i), v) for i, v in enumerate(variables)]


def unroll(step_fn: Callable[..., Any], n: int, *, jit_compile: bool | None = None) -> Callable[..., list[Any]]:
    """Return a ``tf.function`` that runs ``step_fn(*args, **kwargs)`` ``n`` times and
    returns the list of its ``n`` results.

    ``step_fn`` is one training step as plain Python (typically
    ``lambda it: strategy.run(train_step, args=(next(it),))``); if it is already a
    ``tf.function``, its Python function is used, because calling one compiled
    function from another would make each step wait for the whole previous one.
    The loop is unrolled in Python (not a ``tf.while_loop``): every step gets its
    own collective instance keys. Pass an iterator, not a tensor batch, to get a
    new batch per step.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"unroll needs a whole number of steps n >= 1, got {n!r}")
    fn = getattr(step_fn, "python_function", step_fn)
    if not callable(fn):
        raise TypeError(f"unroll needs a callable step function, got {type(step_fn).__name__}")

    def steps(*args: Any, **kwargs: Any) -> list[Any]:
        return [fn(*args, **kwargs) for _ in range(n)]

    steps.__name__ = f"unrolled_{getattr(fn, '__name__', 'step')}_x{n}"
    return tf.function(steps, jit_compile=jit_compile)
