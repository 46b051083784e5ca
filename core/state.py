"""What one rank's scheduler knows, and every change to it. Called with the scheduler's lock held.

The :class:`~commsched.scheduler.Scheduler` owns one lock and this one state; its
threads and the user's calls take the lock, call a method here, and then wake the
threads that the change concerns. Nothing here blocks, starts a thread (except the
abort notice of :class:`~commsched.failures.FailedState`) or calls user code.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future
from typing import Any, Callable, Optional

from commsched import failures
from commsched.errors import CommschedError
from commsched.partition import TensorOps, piece_bounds
from commsched.policy import DispatchPolicy, Unstarted
from commsched.protocol import Channel, Message, Ready
from commsched.stats import Counters
from commsched.task import Piece, Task
from commsched.timeline import now_us

__all__ = ["SchedulerState"]

log = logging.getLogger(__name__)

Bounds = list[tuple[int, int]]


class SchedulerState:
    """Tasks, pieces, bytes in flight, the step, the failed state and the messages to publish.

    Every submitted byte is in exactly one place: in :attr:`unstarted` (not started; or
    its task waits for data), in :attr:`in_flight`, or done; a task stays in
    :attr:`pending` until its future is resolved.
    """

    def __init__(self, policy: DispatchPolicy, ops: TensorOps, partition_bytes: int, channel: Optional[Channel],
                 rank: int, observer: Callable[[Piece, list, int], None] | None) -> None:
        self.policy, self.ops, self.rank, self.observer = policy, ops, rank, observer
        self.partition_bytes = partition_bytes
        self._bounds: dict[tuple[int, int], Bounds] = {}
        self.step = self.seq = self.submitted_in_step = 0
        self.unstarted = Unstarted(in_order=policy.in_reservation_order)
        self.pending: dict[int, Task] = {}
        self.in_flight: dict[int, Piece] = {}
        self.in_flight_bytes = 0
        self.completed: collections.deque[Task] = collections.deque()  # reduced, on_done not run yet
        self.failing: list[Task] = []  # futures to fail (on the completion thread)
        self.outbox: list[Message] = []  # rank 0's decisions (a follower's ready reports) not yet published
        self.step_names: dict[int, set[str]] = collections.defaultdict(set)
        self.failed = failures.FailedState(channel, rank, policy.publishes or policy.reads_decisions)
        self.counters = Counters()

    @property
    def error(self) -> BaseException | None:
        return self.failed.error

    def raise_if_failed(self) -> None:
        """Raise the failed state's error (it never goes back to None, so no lock is needed)."""
        error = self.failed.error
        if error is not None:
            raise error

    def bounds_of(self, name: str, tensor: Any) -> Bounds:
        return self.bounds(int(self.ops.numel(tensor)), int(self.ops.element_size(tensor)), name)

    def bounds(self, numel: int, element_size: int, name: str | None = None) -> Bounds:
        """The pieces of task ``name``, a tensor of that size: the policy's cut where it has one
        (``planned``: the plan group's piece size; raises for a tensor it cannot take), else
        ``partition_bytes`` (computed once per size)."""
        if name is not None:
            planned = self.policy.bounds_for(name, numel, element_size)
            if planned is not None:
                return planned
        key = (int(numel), int(element_size))
        if key not in self._bounds:
            self._bounds[key] = piece_bounds(key[0], key[1], self.partition_bytes)
        return self._bounds[key]

    def submit(self, name: str, priority: int, on_done: Callable[[Task], None] | None, ready: Any, tensor: Any,
               bounds: Bounds) -> Task:
        """A new task with its data; nothing changes if the policy refuses it (raises)."""
        self.policy.admit(self.step, name, len(bounds))
        task = self.new_task(name, priority, on_done, ready)
        try:
            self.attach(task, tensor, bounds)
        except BaseException:
            self.pending.pop(id(task), None)
            raise
        return task

    def reserve(self, name: str, priority: int, on_done: Callable[[Task], None] | None) -> Task:
        """A new task whose data comes later (:meth:`arrived`)."""
        task = self.new_task(name, priority, on_done, None)
        try:
            self.unstarted.wait_for(task)
        except BaseException:
            self.pending.pop(id(task), None)
            raise
        return task

    def new_task(self, name: str, priority: int, on_done: Callable[[Task], None] | None, ready: Any) -> Task:
        """A task of the current step, counted and pending, without data yet."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        task = Task(name=name, tensor=None, priority=int(priority), step=self.step, seq=self.seq, future=future,
                    on_done=on_done, submitted_us=now_us(), ready=ready)
        self.seq += 1
        self.submitted_in_step += 1
        self.counters.task()
        self.step_names[task.step].add(name)
        self.pending[id(task)] = task
        return task

    def attach(self, task: Task, tensor: Any, bounds: Bounds) -> None:
        """Cut ``tensor`` into ``task``'s pieces and hand them to the policy (a zero-size
        tensor is complete at once). Raises if the policy refuses the task."""
        self.policy.admit(task.step, task.name, len(bounds))
        itemsize = int(self.ops.element_size(tensor))
        pieces = []
        for i, (lo, hi) in enumerate(bounds):
            name = f"{task.name}#{i}"
            pieces.append(Piece(task, i, lo, hi, (hi - lo) * itemsize, self.ops.flat_view(tensor, lo, hi), name,
                                algorithm=self.policy.algorithm_of(name)))
        for piece in pieces:
            self.unstarted.add(piece)
        task.tensor, task.pieces, task.remaining = tensor, pieces, len(pieces)
        if not pieces:
            self.completed.append(task)
        for piece in pieces:
            self.policy.add(piece)
        if self.policy.reports_ready:  # a follower tells rank 0 (the publish thread sends the outbox)
            self.outbox.append(Ready(task.step, self.rank, task.name))

    def arrived(self, task: Task, tensor: Any, bounds: Bounds) -> None:
        """A reserved task's data is ready: attach it (and, fifo, the tickets it unblocked)."""
        for each, (each_tensor, each_bounds) in self.unstarted.arrived(task, (tensor, bounds)):
            self.attach(each, each_tensor, each_bounds)

    def end_step(self) -> int:
        """The user ended the current step; the policy checks it first (a refusal fails the state and
        is raised). Returns the ended step."""
        ended = self.step
        try:
            self.policy.step_ended(ended, self.step_names.get(ended, set()))
        except CommschedError as exc:
            self.fail(exc)
            raise
        self.step_names.pop(ended - 2, None)
        self.step += 1
        self.submitted_in_step = 0
        return ended

    def decide(self) -> list[Piece]:
        """Every piece the policy lets start now, marked in flight; its messages go to the outbox.

        A disagreement the policy detects (``CommschedError``) fails the state."""
        batch: list[Piece] = []
        policy = self.policy
        try:
            while True:
                piece = policy.next(self.unstarted, self.step, self.in_flight_bytes)
                if piece is None:
                    over = policy.steps_over(self.unstarted, self.step)
                    if not over:
                        return batch
                    self.outbox += over  # a step ended; a static plan may start now: look again
                    continue
                if self.observer is not None:
                    self.observer(piece, getattr(policy, "queued_keys", list)(), self.in_flight_bytes + piece.nbytes)
                piece.issued_us = now_us()
                self.unstarted.started(piece)
                self.in_flight[id(piece)] = piece
                self.in_flight_bytes += piece.nbytes
                self.counters.issued(piece, self.in_flight_bytes)
                batch.append(piece)
                self.outbox += policy.issued(piece)
        except CommschedError as exc:
            self.fail(exc)
            return batch

    def landed(self, piece: Piece, exc: BaseException | None, remote: str | None) -> bool:
        """The engine finished ``piece`` (``exc`` if it failed; ``remote``: another rank's abort
        notice). True if that completed its task. A second completion is ignored."""
        if piece.done:
            log.error("piece %s completed twice; the engine called done() again (ignored)", piece.name)
            return False
        piece.done = True
        self.in_flight.pop(id(piece), None)
        self.in_flight_bytes -= piece.nbytes
        if exc is not None:
            self.fail(failures.piece_failed(piece, exc, self.rank, remote))
            return False
        self.counters.landed(piece)
        piece.task.remaining -= 1
        if piece.task.remaining:
            return False
        self.completed.append(piece.task)
        return True

    def next_completion(self) -> tuple[list[Task], Task | None]:
        """For the completion thread: the futures to fail, else the next reduced task."""
        if self.failing:
            failing, self.failing = self.failing, []
            return failing, None
        return [], self.completed.popleft()

    def finished(self, task: Task, error: BaseException | None) -> bool:
        """``task``'s ``on_done`` ran (``error`` if it raised); True if that failed the state.

        The task lets go of its pieces (each names its task, so the two made a reference cycle):
        the tensor is freed as soon as the plugin drops it, not at the next garbage collection,
        which never comes where the collector is off (``timeit`` turns it off while it times,
        so every step's gradients stayed alive and each step allocated fresh ones)."""
        self.pending.pop(id(task), None)
        task.pieces = []
        return error is not None and self.fail(error)

    def fail(self, error: BaseException) -> bool:
        """Enter the failed state (the first error stays): every pending future will fail with it.
        False if already failed."""
        if not self.failed.enter(error):
            return False
        self.failing.extend(t for t in self.pending.values() if not t.future.done())
        return True

    def describe(self) -> list[str]:
        """What is not reduced yet, for errors and ``pending()``."""
        return ([f"{p.name} (in flight)" for p in self.in_flight.values()] + self.unstarted.describe()
                + [f"{t.name} (updating)" for t in self.pending.values()
                   if t.remaining == 0 and t.tensor is not None and not self.unstarted.holds(t)])
