"""Group and instance keys for TensorFlow collective ops.

TensorFlow matches the pieces of one collective across workers by
``(group_key, instance_key)``. An instance key must be **unique per collective
for the whole process** and the same on every worker: reusing one while the
runtime still knows the other collective aborts TensorFlow's collective
executor, and only a restart recovers. Keys baked into a graph as constants are
reused by every call of that graph; a counter read at trace time drifts as soon
as one worker retraces and the other does not.

So keys are drawn **when the reduction runs**, from a process-wide int64 counter
kept in a TensorFlow resource (:func:`reserve`): each reduction adds its number
of pieces ``n`` to the counter and uses the ``n`` keys before the new value.
Every use of the counter is one resource, so TensorFlow's automatic control
dependencies run the draws of one function in program order; workers that run
the same steps draw the same keys, however often and whenever each of them
traced. Two functions, two calls of one function, two calls of one inner
``tf.function`` inside an outer one, and the branches of a ``tf.cond`` all draw
distinct keys. Not inside a ``tf.while_loop``, whose iterations may overlap:
:func:`reserve` refuses it (run several steps per function with ``unroll``).
(``MultiWorkerMirroredStrategy`` feeds a key per call through
``FuncGraph.capture_call_time_value`` instead; that capture is made once per outer
function, so an inner function called twice would reuse its keys; the counter
does not have that hole.)

The counter ops have no input from the model, so they run at the start of the
step and never delay a collective. commsched uses its own group key
(:data:`GROUP_KEY`), so its instance keys cannot collide with the strategy's.
"""

from __future__ import annotations

import threading

import tensorflow as tf

__all__ = ["FIRST_INSTANCE_KEY", "GROUP_KEY", "KEY_RANGE", "counter_value", "instance_key", "reserve"]

#: commsched's collective group key: distinct from the strategy's (which count up from 1).
GROUP_KEY = 0x434D5300  # "CMS\0", an int32
#: Instance keys are ``FIRST_INSTANCE_KEY + (n mod KEY_RANGE)`` for the n-th piece of the process.
FIRST_INSTANCE_KEY = 1 << 16
KEY_RANGE = (1 << 31) - 1 - FIRST_INSTANCE_KEY  # wraps after ~2**31 pieces, long after they finished

_SHARED_NAME = "commsched_instance_key_counter"
_WHILE_GRAPHS = ("WhileBodyFuncGraph", "WhileCondFuncGraph")
_handle: tf.Tensor | None = None
_lock = threading.Lock()


def _counter() -> tf.Tensor:
    """The counter's resource handle, created (eagerly, on this worker's CPU) on first use."""
    global _handle
    with _lock:
        if _handle is None:
            with tf.init_scope(), tf.device("CPU:0"):
                handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name=_SHARED_NAME)
                if not bool(tf.raw_ops.VarIsInitializedOp(resource=handle)):
                    tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(0, tf.int64))
            _handle = handle
        return _handle


def reserve(n: int) -> tf.Tensor:
    """Reserve ``n`` instance keys for a reduction about to run; returns the first as an
    int64 counter value ``start`` (use :func:`instance_key` for piece ``k``).

    Eagerly the keys are drawn now; in a ``tf.function`` each execution draws new ones.
    """
    if n < 0 or n >= KEY_RANGE:
        raise ValueError(f"cannot reserve {n} instance keys at once")
    if not tf.executing_eagerly():
        _check_graph(tf.compat.v1.get_default_graph())
    handle = _counter()
    with tf.device("CPU:0"), tf.name_scope("commsched_keys"):
        count = tf.constant(n, tf.int64)
        tf.raw_ops.AssignAddVariableOp(resource=handle, value=count)
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int64) - count


def _check_graph(graph) -> None:
    if not getattr(graph, "building_function", False):
        raise ValueError("commsched's TensorFlow plugin needs TF2 behaviour (eager or tf.function), not a TF1 graph")
    while graph is not None and getattr(graph, "is_control_flow_graph", False):
        if type(graph).__name__ in _WHILE_GRAPHS:
            raise ValueError(
                "commsched cannot reduce gradients inside a tf.while_loop (overlapping iterations could draw the "
                "same collective instance keys). Keep steps_per_execution=1 in model.compile, and run several "
                "steps per function with commsched.plugins.tensorflow.unroll(step_fn, n), which unrolls in Python")
        graph = getattr(graph, "outer_graph", None)


def instance_key(start: tf.Tensor, k: int) -> tf.Tensor:
    """The int32 instance key of piece ``k`` of a reduction that reserved from ``start``."""
    with tf.device("CPU:0"):
        return tf.cast(FIRST_INSTANCE_KEY + (start + k) % KEY_RANGE, tf.int32)


def counter_value() -> int:
    """How many instance keys this process has drawn so far (for tests and debugging)."""
    handle = _counter()
    with tf.init_scope(), tf.device("CPU:0"):
        return int(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int64))
