"""Public helpers: ``function`` (``tf.function`` whose failures of commsched's pieces are
commsched's errors), ``unroll`` (several training steps in one such function, for
cross-iteration overlap) and ``plan_model`` (the model as a plan names it).

A compiled step runs its graph without commsched's Python code on the call path, so a
piece that fails there (a worker died, or hangs) reaches a plain ``tf.function``'s
caller as TensorFlow's ``UnavailableError``/``DeadlineExceededError``. :func:`function`
is ``tf.function`` plus that translation (:mod:`commsched.plugins.tensorflow.failures`):
the caller gets a :class:`~commsched.errors.CommunicationError` or
:class:`~commsched.errors.CommschedTimeout` naming the piece, the TF error as its cause.

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

import functools
import weakref
from typing import Any, Callable, Iterable

import tensorflow as tf

from commsched.plan import PlannedTensor
from commsched.plugins.tensorflow.failures import raise_translated
from commsched.plugins.tensorflow.reduction import (planned_tensor, process_report, static_pending, tracing_into,
                                                    variable_name)

__all__ = ["function", "plan_model", "report", "unroll"]


def report(topology: Any = None) -> str:
    """A short summary of every reduction this process traced (optimizers and tapes alike):
    bytes and pieces per step; as measured in the graph, communication in flight, exposed
    communication, effective bandwidth; the settings in use; with ``topology`` (a
    :class:`commsched.costmodel.Topology`) what the network should take and the simulator's
    expected step. ``opt.report()`` and ``tape.report()`` cover one optimizer or tape."""
    return process_report(topology)


#: ``ordering="static"``: a step compiled by :func:`function` is traced again before this call
#: (1-based) while a static reducer has planned only from the model; by then its first trace
#: has run twice after its warm-up run (the runs :func:`~.stats.observed_readiness` needs).
RETRACE_AT_CALL = 4


class CompiledStep:
    """A ``tf.function`` whose calls raise commsched's error for a failed commsched piece
    (anything else goes through as raised). Other attributes are the ``tf.function``'s
    (``get_concrete_function``, ``experimental_get_tracing_count``, ``python_function``).

    ``rebuild`` (set by :func:`function` for what it compiles): a new ``tf.function`` of the
    same Python function. Before call :data:`RETRACE_AT_CALL` it replaces the compiled one
    once if a reducer with ``ordering="static"`` that its own trace used still plans from the
    model (:func:`~.reduction.static_pending`; another step's reducers do not count): the new
    trace plans from the order the first one measured. Every worker calls its step as often, so
    every worker traces again at the same call."""

    def __init__(self, compiled: Any, rebuild: Callable[[], Any] | None = None) -> None:
        self._compiled = compiled
        self._rebuild = rebuild
        self._calls = 0
        self._reducers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the static reducers its traces used
        functools.update_wrapper(self, compiled, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls += 1
        if self._calls == RETRACE_AT_CALL and self._rebuild is not None and static_pending(self._reducers):
            self._compiled = self._rebuild()
        try:
            with tracing_into(self._reducers):  # a call may trace (the first, a new signature, the retrace)
                return self._compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (translated or re-raised unchanged)
            raise_translated(exc)

    def __get__(self, instance: Any, owner: Any = None) -> Any:  # decorating a method
        return self if instance is None else CompiledStep(self._compiled.__get__(instance, owner))

    def __getattr__(self, name: str) -> Any:
        if name == "_compiled":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._compiled, name)


def function(fn: Callable[..., Any] | None = None, **tf_function_kwargs: Any) -> Any:
    """``tf.function(fn, **tf_function_kwargs)`` (also as ``@function`` or ``@function(...)``)
    whose calls raise commsched's errors when one of commsched's pieces fails:

    * a worker gone (TF's ``UnavailableError``, ``CancelledError``, ...):
      :class:`~commsched.errors.CommunicationError` naming the tensor and piece;
    * a worker silent past ``timeout_s`` (``DeadlineExceededError``):
      :class:`~commsched.errors.CommschedTimeout`, ``pending`` naming the piece;
    * a commsched error raised while the function was traced, which AutoGraph wraps in
      a ``StagingError``: that commsched error.

    The TF error is the ``__cause__``. Errors that are not about commsched's pieces go
    through unchanged. ``fn`` may already be a ``tf.function``.

    With ``ordering="static"``, what it compiles from a Python function is traced once more,
    at call :data:`RETRACE_AT_CALL`, so the plan follows the order and link rate the graph
    measured (:class:`CompiledStep`; docs/tensorflow.md, step 2). A ``tf.function`` passed in
    is not traced again (trace it again yourself, e.g. ``model.make_train_function(force=True)``).
    """
    if fn is None:
        return lambda f: function(f, **tf_function_kwargs)
    if isinstance(fn, CompiledStep):
        return fn
    if hasattr(fn, "get_concrete_function"):  # already a tf.function
        if tf_function_kwargs:
            raise ValueError(f"function(): {getattr(fn, '__name__', fn)!r} is already a tf.function; pass its Python "
                             f"function to set {', '.join(sorted(tf_function_kwargs))}")
        return CompiledStep(fn)
    if not callable(fn):
        raise TypeError(f"function() compiles a callable, got {type(fn).__name__}")
    return CompiledStep(tf.function(fn, **tf_function_kwargs), lambda: tf.function(fn, **tf_function_kwargs))


def plan_model(variables: Iterable[Any]) -> list[PlannedTensor]:
    """The plan's model entries for ``variables`` (pass ``model.trainable_variables``, in that
    order, as the optimizer and the tape see them): the names ``ordering="planned"`` checks
    a plan against, with element count, element size, shape and dtype."""
    return [planned_tensor(variable_name(v, i), v) for i, v in enumerate(variables)]


def unroll(step_fn: Callable[..., Any], n: int, *, jit_compile: bool | None = None) -> Callable[..., list[Any]]:
    """Return a compiled :func:`function` that runs ``step_fn(*args, **kwargs)`` ``n`` times
    and returns the list of its ``n`` results.

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
    return function(steps, jit_compile=jit_compile)
