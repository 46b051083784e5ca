"""What the graph measures of its own reduction: wall-clock stamps per piece, per run.

A TensorFlow step is a graph, so commsched's Python code is not there when the pieces
run. The graph stamps them itself: for every piece of one traced reduction it records

* ``ready``: when the piece's gradient data existed,
* ``done``: when its reduced value existed,

plus ``start``, when the step's function began (a stamp with no input). A piece's
``issue`` time follows from them: its collective can start once its data exists and
the previous collective on its ordering chain has finished, ``max(ready, done of the
previous piece on the slot)``, never later than its own ``done``: a ``done`` stamp is an op
of its own, run when the executor gets to it, so the previous piece's may be taken after
this piece's own (a local collective is over in microseconds; seen in CI), and the real
start of a piece is never after its end. The stamps never order pieces: a collective waits only
for the stamp of its own data (taken once that data exists, so ``ready <= issue``
holds exactly), never for another piece's, so the chains are the tokens' alone. The stamps
(``tf.timestamp``, seconds since the epoch, microsecond resolution) of the last
:data:`CAPACITY` runs are kept in a ring buffer on this worker's CPU, with a count of
runs; :meth:`Recorder.runs` reads them.

Why each stamp is a call of a tiny function that takes an unused resource: a bare
``tf.timestamp`` is a stateful op without resource inputs, and TensorFlow's automatic
control dependencies chain every such op to the one created before it, so the stamps
of pieces on different chains would wait for each other. A function with a
(read-only) resource argument is ordered only against writes of that resource, and
nothing writes it. The stamps never touch the gradients: the reduction is bit for bit
the same with them.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

__all__ = ["CAPACITY", "Recorder", "Run"]

#: Runs kept per traced reduction (the newest; older ones are overwritten).
CAPACITY = 64

_ids = itertools.count()
_lock = threading.Lock()
_anchor: tf.Tensor | None = None


def _anchor_handle() -> tf.Tensor:
    """The resource every stamp takes (never read or written: it only frees stamps from the chain)."""
    global _anchor
    with _lock:
        if _anchor is None:
            with tf.init_scope(), tf.device("CPU:0"):
                _anchor = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="commsched_stamp_anchor")
        return _anchor


@tf.function(autograph=False)
def _stamp(anchor: tf.Tensor) -> tf.Tensor:
    return tf.timestamp()


def stamp(*after: tf.Tensor) -> tf.Tensor:
    """A float64 wall-clock time taken once every tensor in ``after`` exists (at once if none).

    The tensors are control inputs of the call (inlined, they hold back its body), not
    arguments: one trace of the stamp function serves every piece shape."""
    with tf.device("CPU:0"), tf.control_dependencies(list(after)):
        return _stamp(_anchor_handle())


@dataclass(frozen=True)
class Run:
    """One measured run of a traced reduction: stamps in seconds since the epoch, per piece in
    the plan's order."""

    start: float
    ready: np.ndarray
    done: np.ndarray
    slots: tuple[int, ...]

    @property
    def issue(self) -> np.ndarray:
        """When each piece could start: ``max(ready, done of the previous piece on its slot)``,
        at most its own ``done`` (the previous piece's done stamp may run late; module doc)."""
        issue = self.ready.copy()
        last: dict[int, float] = {}
        for k, slot in enumerate(self.slots):
            if slot in last:
                issue[k] = min(max(issue[k], last[slot]), float(self.done[k]))
            last[slot] = float(self.done[k])
        return issue

    @property
    def comm_s(self) -> float:
        """Time at least one piece was in flight: the union of the ``[issue, done]`` intervals."""
        total, end = 0.0, -np.inf
        for a, b in sorted(zip(self.issue.tolist(), self.done.tolist(), strict=True)):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total

    @property
    def tail_s(self) -> float:
        """From the last gradient ready to the last piece reduced: what the step waits on the
        network after backward (exposed, unless the next step's forward overlaps it)."""
        return max(0.0, float(self.done.max() - self.ready.max())) if self.done.size else 0.0

    @property
    def compute_s(self) -> float:
        """From the step's start to the last gradient ready: forward and backward (with whatever
        ran between them in the user's step)."""
        return max(0.0, float(self.ready.max() - self.start)) if self.ready.size else 0.0


class Recorder:
    """The stamps of one traced reduction whose pieces run on ordering chains ``slots`` (one per
    piece, in the plan's order); every run of its graph writes one row."""

    def __init__(self, slots: list[int], capacity: int = CAPACITY) -> None:
        n = len(slots)
        if n < 1 or capacity < 1:
            raise ValueError(f"a recorder needs n >= 1 pieces and capacity >= 1, got n={n}, capacity={capacity}")
        self.n, self.capacity, self.slots = n, int(capacity), tuple(int(s) for s in slots)
        name = f"commsched_stamps_{next(_ids)}"
        # Raw resource handles made eagerly (init_scope), also while a function is traced
        # (tf.function refuses new tf.Variables after its first trace); no model or
        # checkpoint tracks them. On this worker's CPU.
        with tf.init_scope(), tf.device("CPU:0"):
            self._rows = tf.raw_ops.VarHandleOp(dtype=tf.float64, shape=[self.capacity, 1 + 2 * self.n],
                                                shared_name=name)
            tf.raw_ops.AssignVariableOp(resource=self._rows,
                                        value=tf.zeros([self.capacity, 1 + 2 * self.n], tf.float64))
            self._count = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name=name + "_count")
            tf.raw_ops.AssignVariableOp(resource=self._count, value=tf.constant(0, tf.int64))
            self._started = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name=name + "_started")
            tf.raw_ops.AssignVariableOp(resource=self._started, value=tf.constant(0, tf.int64))

    def begin(self, after: tf.Tensor) -> None:
        """Count a run as started once ``after`` (the plan's first gradient) exists (the watchdog's
        reference: :mod:`commsched.plugins.tensorflow.watchdog`)."""
        with tf.device("CPU:0"), tf.name_scope("commsched_stamps"), tf.control_dependencies([after]):
            tf.raw_ops.AssignAddVariableOp(resource=self._started, value=tf.constant(1, tf.int64))

    def progress(self) -> tuple[int, int]:
        """``(runs started, runs finished)`` so far (read eagerly; safe from another thread)."""
        with tf.init_scope(), tf.device("CPU:0"):
            started = int(tf.raw_ops.ReadVariableOp(resource=self._started, dtype=tf.int64))
            finished = int(tf.raw_ops.ReadVariableOp(resource=self._count, dtype=tf.int64))
        return started, finished

    def record(self, start: tf.Tensor, ready: list[tf.Tensor], done: list[tf.Tensor]) -> None:
        """Write this run's stamps (in graph or eagerly) into the next row of the ring."""
        if not (len(ready) == len(done) == self.n):
            raise ValueError(f"expected {self.n} stamps of each kind, got {len(ready)} and {len(done)}")
        with tf.device("CPU:0"), tf.name_scope("commsched_stamps"):
            row = tf.stack([start] + list(ready) + list(done))
            with tf.control_dependencies([row]):  # a run counts once all its pieces are done
                tf.raw_ops.AssignAddVariableOp(resource=self._count, value=tf.constant(1, tf.int64))
            count = tf.raw_ops.ReadVariableOp(resource=self._count, dtype=tf.int64)
            tf.raw_ops.ResourceScatterUpdate(resource=self._rows, indices=tf.reshape((count - 1) % self.capacity, [1]),
                                             updates=row[None, :])

    def count_only(self, results: list[tf.Tensor]) -> None:
        """Count this run, once every tensor of ``results`` exists, without stamps (``measure=False``):
        bytes and pieces per step stay known, and the watchdog sees the run finish."""
        with tf.device("CPU:0"), tf.name_scope("commsched_stamps"), tf.control_dependencies(results):
            tf.raw_ops.AssignAddVariableOp(resource=self._count, value=tf.constant(1, tf.int64))
        self.unmeasured = True

    unmeasured = False  #: runs were counted without stamps (their ring rows are empty)

    @property
    def count(self) -> int:
        """How many runs have recorded so far."""
        with tf.init_scope():
            return int(tf.raw_ops.ReadVariableOp(resource=self._count, dtype=tf.int64))

    def runs(self) -> list[Run]:
        """The recorded runs still in the ring, oldest first."""
        with tf.init_scope():
            count = int(tf.raw_ops.ReadVariableOp(resource=self._count, dtype=tf.int64))
            rows = tf.raw_ops.ReadVariableOp(resource=self._rows, dtype=tf.float64).numpy()
        kept = min(count, self.capacity)
        order = [(count - kept + i) % self.capacity for i in range(kept)]
        n = self.n
        return [Run(float(rows[r, 0]), rows[r, 1:1 + n].copy(), rows[r, 1 + n:].copy(), self.slots) for r in order]
