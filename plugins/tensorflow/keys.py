"""Group and instance keys for TensorFlow collective ops.

TensorFlow matches the pieces of one collective across workers by
``(group_key, instance_key)``. Two rules, learnt the hard way:

* an instance key must be **unique per collective for the whole process** and the
  same on every worker. Reusing one while another collective with that key is
  known to the runtime aborts TensorFlow's collective executor, and only a
  restart recovers;
* keys written into a graph as constants are reused by every call of that graph,
  and retracing on one worker but not the other shifts any counter read at
  trace time.

So keys are drawn **at call time**, exactly like ``MultiWorkerMirroredStrategy``
does it: each traced function captures one scalar ``base`` through
``FuncGraph.capture_call_time_value``; when the function is called, a callback
reserves a block of ``count`` consecutive keys (``count`` = the collectives
traced into it) from the process-wide :class:`InstanceKeyAllocator`, and collective
``k`` of the graph uses ``base + k``. Workers that call the same functions in the
same order therefore draw the same keys, however often or whenever each of them
traced; two functions, or two calls of one function, never share a key. A call
made while tracing an outer function defers once more, to that function's call.

commsched uses its own group key (:data:`GROUP_KEY`), so its instance keys
cannot collide with the strategy's own collectives.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import tensorflow as tf

__all__ = ["GROUP_KEY", "FIRST_INSTANCE_KEY", "InstanceKeyAllocator", "allocator", "reserve"]

#: commsched's collective group key: distinct from the strategy's (which count up from 1).
GROUP_KEY = 0x434D5300  # "CMS\0", an int32
#: The first instance key handed out; keys wrap around below 2**31.
FIRST_INSTANCE_KEY = 1 << 16
_KEY_LIMIT = (1 << 31) - 1

_WHILE_GRAPHS = ("WhileBodyFuncGraph", "WhileCondFuncGraph")


class InstanceKeyAllocator:
    """Hands out blocks of consecutive instance keys; thread-safe.

    ``take(n)`` returns the first key of a block of ``n`` keys never handed out
    before (until, after about 2**31 keys, the range wraps around; by then every
    earlier collective has long finished). The sequence depends only on the
    sequence of calls, which is what makes it identical on every worker.
    ``history`` keeps the most recent blocks, for tests and debugging.
    """

    def __init__(self, first: int = FIRST_INSTANCE_KEY, limit: int = _KEY_LIMIT, history: int = 4096) -> None:
        if not 0 < first < limit:
            raise ValueError(f"instance keys need 0 < first < limit, got first={first}, limit={limit}")
        self._first = first
        self._limit = limit
        self._next = first
        self._lock = threading.Lock()
        self._history_size = history
        self.history: list[tuple[int, int]] = []

    def take(self, n: int) -> int:
        """Reserve ``n`` consecutive keys; returns the first."""
        if n < 0 or n > self._limit - self._first:
            raise ValueError(f"cannot reserve {n} instance keys at once")
        with self._lock:
            if self._next + n > self._limit:
                self._next = self._first
            base = self._next
            self._next += n
            if self._history_size:
                self.history.append((base, n))
                del self.history[:-self._history_size]
            return base


_allocator: InstanceKeyAllocator | None = None
_allocator_lock = threading.Lock()


def allocator() -> InstanceKeyAllocator:
    """The process-wide allocator (created on first use: TensorFlow's collective
    executor is process-wide, so its key space is too)."""
    global _allocator
    with _allocator_lock:
        if _allocator is None:
            _allocator = InstanceKeyAllocator()
        return _allocator


class _GraphKeys:
    """Keys of one traced function: how many it uses, and its call-time ``base``."""

    def __init__(self) -> None:
        self.count = 0
        self.base: Any = None  # weakref to the placeholder (the graph owns it)

    def call_time_base(self) -> tf.Tensor:
        # Runs each time the function is called (tracing is over: count is final).
        outer = tf.compat.v1.get_default_graph()
        if not tf.executing_eagerly() and getattr(outer, "building_function", False):
            base, offset = reserve(self.count)  # called while tracing an outer function
            return base + offset if offset else base
        with tf.device("CPU:0"):
            return tf.constant(allocator().take(self.count), dtype=tf.int32)


_graphs: "weakref.WeakKeyDictionary[Any, _GraphKeys]" = weakref.WeakKeyDictionary()
_graphs_lock = threading.Lock()


def _outer_function_graph() -> Any:
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        if type(graph).__name__ in _WHILE_GRAPHS:
            raise ValueError(
                "commsched cannot reduce gradients inside a tf.while_loop (each iteration would reuse the same "
                "collective instance keys). Keep steps_per_execution=1 in model.compile, and run several steps "
                "per function with commsched.plugins.tensorflow.unroll(step_fn, n), which unrolls them in Python")
        graph = graph.outer_graph
    return graph


def reserve(n: int) -> tuple[Any, int]:
    """Reserve ``n`` instance keys for collectives being created now.

    Returns ``(base, offset)``: collective ``k`` (0 <= k < n) uses ``base + offset + k``.
    Eagerly, ``base`` is a Python int drawn now; inside a function being traced it
    is that function's call-time scalar (see the module docstring).
    """
    if tf.executing_eagerly():
        return allocator().take(n), 0
    graph = _outer_function_graph()
    if not getattr(graph, "building_function", False):
        raise ValueError("commsched's TensorFlow plugin needs TF2 behaviour (eager or tf.function), not a TF1 graph")
    with _graphs_lock:
        state = _graphs.get(graph)
        if state is None:
            state = _graphs[graph] = _GraphKeys()
        base = state.base() if state.base is not None else None
        if base is None:
            with graph.as_default():
                base = graph.capture_call_time_value(state.call_time_base, tf.TensorSpec([], tf.int32))
            state.base = weakref.ref(base)
        offset = state.count
        state.count += n
    return base, offset
