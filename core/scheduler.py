"""The scheduler: partition, priority, credit and order agreement in one place.

Data flows down (``submit`` → pieces → ``Backend.start``) and completions flow up
(``done`` callback → task future → the plugin's ``on_done``). Four named threads:

* ``dispatch`` decides which piece starts next and starts it;
* ``complete`` resolves task futures and runs ``on_done`` callbacks, so that the
  engine's own threads never run user code;
* ``publish`` (rank 0, ``dynamic``/``static``) sends rank 0's decisions to the
  others through the store, in batches, without blocking ``dispatch``;
* ``order`` (other ranks, ``dynamic``/``static``) reads those decisions from its
  own queue in the store (blocking, so no polling; ``close()`` wakes it).

Invariants (tested in ``tests/core``):

1. bytes in flight ≤ ``credit_bytes``, except that one piece larger than the
   credit may go alone when nothing else is in flight;
2. among ready pieces the deciding rank starts the most urgent first: the
   smallest ``(step, priority)``, ties in submission order;
3. with ``dynamic`` and ``static`` every rank starts exactly the same sequence of
   pieces; every submitted piece is started exactly once and completed at most
   once;
4. every future resolves, with a result or an exception; an exception on a
   background thread surfaces at the next call of the user's thread, and no
   wait is longer than ``timeout_s``.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from commsched.config import SchedulerConfig
from commsched.lifecycle import close_at_exit
from commsched.errors import (
    CommschedError,
    CommschedTimeout,
    CommunicationError,
    OrderAgreementError,
    RemoteAbort,
    SchedulerClosed,
)
from commsched.partition import TensorOps, piece_bounds
from commsched.store import Store
from commsched.timeline import Timeline, now_us

__all__ = ["Backend", "Piece", "Scheduler", "Task", "Ticket"]

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often a blocked wait looks for another rank's abort


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or "\t" in name or "\n" in name or "\x1f" in name:
        raise ValueError(f"tensor name {name!r} must be a non-empty str without tabs or newlines")


class Backend(Protocol):
    """The collective engine under the scheduler (provided by a plugin).

    ``start(piece, done)`` begins an in-place sum-all-reduce (or push/pull) of
    ``piece.view`` and returns without waiting; the engine later calls
    ``done(None)`` or ``done(exception)`` exactly once, from any thread.
    ``negotiates_order`` is True for engines that match operations by name
    (Horovod): then only rank 0 paces by priority and credit. ``close()`` releases
    what the engine holds (threads, groups); :meth:`Scheduler.close` calls it once,
    after its own threads stopped, and so does interpreter exit for a scheduler the
    user forgot to close. It must be safe to call twice.
    """

    rank: int
    world_size: int
    negotiates_order: bool

    def start(self, piece: "Piece", done: Callable[[Optional[BaseException]], None]) -> None: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Task:
    """One submitted tensor; ``future`` resolves to the tensor once every piece is reduced.

    ``ready`` is what the plugin passed to :meth:`Scheduler.submit` to say when the
    tensor's data is ready on the device (a CUDA event, say); the backend may wait on
    it before it starts a piece. ``handles`` is where a backend keeps the engine's
    handles of this task's pieces, for a plugin that must order later work after them.
    """

    name: str
    tensor: Any
    priority: int
    step: int
    seq: int
    future: Future
    on_done: Optional[Callable[["Task"], None]]
    submitted_us: float
    ready: Any = None
    handles: list = field(default_factory=list)
    pieces: list["Piece"] = field(default_factory=list)
    remaining: int = 0


@dataclass(eq=False)
class Piece:
    """A contiguous slice ``[start, stop)`` of a task's flattened tensor, as a zero-copy ``view``."""

    task: Task
    index: int
    start: int
    stop: int
    nbytes: int
    view: Any
    name: str
    issued: bool = False
    done: bool = False
    issued_us: float = 0.0

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.task.step, self.task.priority, self.task.seq, self.index)


class Ticket:
    """A tensor announced by :meth:`Scheduler.reserve` whose data is not ready yet.

    ``future`` resolves like the future of :meth:`Scheduler.submit`. Call
    :meth:`ready` once, from any thread, when the data is written.
    """

    __slots__ = ("_scheduler", "task")

    def __init__(self, scheduler: "Scheduler", task: Task) -> None:
        self._scheduler = scheduler
        self.task = task

    @property
    def future(self) -> Future:
        return self.task.future

    @property
    def name(self) -> str:
        return self.task.name

    def ready(self, tensor: Any) -> None:
        """The data is ready: hand ``tensor`` to the scheduler. Never raises (it runs on
        engine threads): an error fails the scheduler, the future and the next user call."""
        self._scheduler._ticket_ready(self.task, tensor)


class Scheduler:
    """Schedules the reduction of submitted tensors on one rank.

    Args:
        backend: the collective engine (see :class:`Backend`).
        ops: the framework's tensor operations (see :class:`~commsched.partition.TensorOps`).
        config: a :class:`~commsched.config.SchedulerConfig` (default: from the environment).
        store: the rendezvous store shared by all ranks; required with more than one
            rank for ``dynamic`` and ``static`` ordering on engines that do not
            negotiate order.
        key_prefix: namespace of this scheduler's keys in the store; must be the
            same on every rank and differ between schedulers sharing a store.

    Priorities: smaller is more urgent (0 is what the next forward needs first).
    Call :meth:`mark_step` once per training step, after every tensor of the step
    was submitted; it is what lets ranks check that they agree.
    """

    def __init__(self, backend: Backend, ops: TensorOps, config: SchedulerConfig | None = None, *,
                 store: Store | None = None, key_prefix: str = "commsched") -> None:
        self.config = config if config is not None else SchedulerConfig()
        self.backend = backend
        self.ops = ops
        self.rank = int(backend.rank)
        self.world_size = int(backend.world_size)
        self._store = store
        self._prefix = key_prefix
        self._credit = self.config.credit_bytes
        self._mode = self._choose_mode(backend)
        self._static = self.config.ordering == "static" and self._mode in ("leader", "follower")
        if self._mode in ("leader", "follower") and store is None:
            raise ValueError(
                f"ordering={self.config.ordering!r} with {self.world_size} ranks needs a store to agree on order; "
                "pass store=... (the plugin does this), or use ordering='fifo' only on an engine that agrees on "
                "order itself"
            )
        self.timeline = Timeline(self.config.timeline, self.rank, self.world_size)

        self._lock = threading.Lock()
        self._dispatch_cv = threading.Condition(self._lock)
        self._complete_cv = threading.Condition(self._lock)
        self._publish_cv = threading.Condition(self._lock)
        self._idle_cv = threading.Condition(self._lock)

        self._seq = 0
        self._step = 0
        self._submitted_in_step = 0
        self._heap: list[tuple[int, int, int, int, Piece]] = []
        self._fifo: collections.deque[Piece] = collections.deque()
        self._unissued: dict[tuple[int, str], Piece] = {}
        self._unissued_per_step: collections.Counter[int] = collections.Counter()  # pieces + waiting tickets
        self._waiting: dict[tuple[int, str], Task] = {}  # reserved, data not ready yet
        self._reserved_order: collections.deque[Task] = collections.deque()  # fifo: tickets in reservation order
        self._parked: dict[int, list[tuple[int, int]]] = {}  # fifo: ready tickets behind an earlier one
        self._bounds_cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._pending: dict[int, Task] = {}
        self._in_flight: dict[int, Piece] = {}
        self._in_flight_bytes = 0
        self._completed: collections.deque[Task] = collections.deque()
        # order agreement
        self._agreed: collections.deque[tuple] = collections.deque()
        self._publish_buf: list[str] = []
        self._end_sent_upto = 0  # steps < this have had their END marker published
        self._plan: list[str] | None = None
        self._plan_names: set[str] = set()
        self._plan_pos = 0
        self._plan_step = 1
        self._step0_order: list[str] = []
        self._step_names: dict[int, set[str]] = collections.defaultdict(set)
        # state
        self._error: BaseException | None = None
        self._failing: list[Task] = []
        self._abort_thread: threading.Thread | None = None
        self._order_lost: BaseException | None = None
        self._closing = False
        self._closed = False
        self._observer: Callable[[str, dict], None] | None = None
        # stats
        self._stats = {"pieces": 0, "bytes": 0, "tasks": 0, "max_in_flight_bytes": 0, "steps": 0}
        self._step_stats: dict[int, dict] = {}

        self._threads: list[threading.Thread] = []
        self._spawn("dispatch", self._dispatch_loop)
        self._spawn("complete", self._complete_loop)
        if self._mode == "leader":
            self._spawn("publish", self._publish_loop)
        elif self._mode == "follower":
            self._spawn("order", self._order_loop)
        close_at_exit(self, min(self.config.timeout_s, 10.0))

    # ------------------------------------------------------------------ setup
    def _choose_mode(self, backend: Backend) -> str:
        if self.world_size <= 1:
            return "local"
        if self.config.ordering == "fifo":
            return "fifo"
        if getattr(backend, "negotiates_order", False):
            return "local" if self.rank == 0 else "immediate"
        return "leader" if self.rank == 0 else "follower"

    def _spawn(self, what: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=self._guard(target), name=f"commsched-{what}-r{self.rank}", daemon=False)
        self._threads.append(thread)
        thread.start()

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # a bug or engine failure on a background thread
                log.exception("commsched background thread failed")
                name = threading.current_thread().name
                self._fail(CommschedError(f"commsched background thread {name} failed: {exc!r}"),
                           cause=exc)
        return run

    # --------------------------------------------------------------- user API
    @property
    def mode(self) -> str:
        """How this rank decides order: local, leader, follower, fifo or immediate."""
        return self._mode

    @property
    def error(self) -> BaseException | None:
        """The error that put this scheduler in its failed state, or None while it is healthy."""
        return self._error

    @property
    def step(self) -> int:
        """The current step number (advanced by :meth:`mark_step`)."""
        return self._step

    def submit(self, name: str, tensor: Any, priority: int = 0,
               on_done: Callable[[Task], None] | None = None, *, ready: Any = None) -> Future:
        """Queue ``tensor`` for an in-place reduction; returns a future of ``tensor``.

        ``name`` must be the same on every rank and unique among this scheduler's
        unfinished tasks. ``on_done(task)`` runs on the completion thread once every
        piece is reduced, before the future resolves; an exception it raises fails
        the future and surfaces at the next call. ``ready`` is handed to the backend
        as ``task.ready`` (see :class:`Task`).
        """
        _check_name(name)
        bounds = self._bounds_of(tensor)
        with self._lock:
            self._check_usable()
            task = self._new_task(name, priority, on_done, ready)
            self._attach(task, tensor, bounds)
        return task.future

    def reserve(self, name: str, priority: int = 0, on_done: Callable[[Task], None] | None = None) -> Ticket:
        """Announce a tensor whose data is not ready yet; :meth:`Ticket.ready` hands it over later.

        For engines whose data is written asynchronously (MXNet's engine threads): the
        tensor belongs to the current step, :meth:`synchronize` and :meth:`pending`
        count it from now on, and order agreement waits for it rather than calling it
        missing. With ``ordering="fifo"`` tickets are submitted in reservation order (a
        ticket ready early waits for the earlier ones), so every rank issues in the
        order its user thread reserved; otherwise each goes as soon as it is ready.
        """
        _check_name(name)
        with self._lock:
            self._check_usable()
            task = self._new_task(name, priority, on_done, None)
            key = (task.step, name)
            if key in self._waiting:
                raise ValueError(f"tensor {name!r} was reserved twice in step {task.step}; names must be unique "
                                 "per step")
            self._waiting[key] = task
            self._unissued_per_step[task.step] += 1  # the step is not over while its data is missing
            self._pending[id(task)] = task
            if self._mode == "fifo":
                self._reserved_order.append(task)
        return Ticket(self, task)

    def _ticket_ready(self, task: Task, tensor: Any) -> None:
        try:
            bounds = self._bounds_of(tensor)
        except BaseException as exc:
            self._fail(CommschedError(f"tensor {task.name!r} cannot be reduced: {exc}"), cause=exc)
            return
        with self._lock:
            if self._closed or self._error is not None or self._waiting.get((task.step, task.name)) is not task:
                return  # failed or closed meanwhile: its future has failed already
            del self._waiting[(task.step, task.name)]
            self._unissued_per_step[task.step] -= 1
            if not self._unissued_per_step[task.step]:
                del self._unissued_per_step[task.step]
            task.tensor = tensor
            ready = [(task, bounds)]
            if self._mode == "fifo":  # parked until every earlier ticket is ready
                self._parked[id(task)] = bounds
                order = self._reserved_order
                ready = []
                while order and id(order[0]) in self._parked:
                    head = order.popleft()
                    ready.append((head, self._parked.pop(id(head))))
            try:
                for each, each_bounds in ready:
                    self._attach(each, each.tensor, each_bounds)
            except BaseException as exc:  # the static plan refuses it, say: fail, never raise here
                self._fail_locked(exc if isinstance(exc, CommschedError) else
                                  CommschedError(f"tensor {task.name!r} cannot be reduced: {exc}"))

    def bounds(self, numel: int, element_size: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` element ranges of the pieces of a tensor of that size.

        This is what :meth:`submit` cuts with (``partition_bytes`` of the config);
        computed once per size. A plugin that must name pieces in advance (MXNet's
        sub-keys) uses this, so it always agrees with the scheduler.
        """
        key = (int(numel), int(element_size))
        found = self._bounds_cache.get(key)
        if found is None:
            found = self._bounds_cache[key] = piece_bounds(key[0], key[1], self.config.partition_bytes)
        return found

    def abort(self, error: BaseException) -> None:
        """Put the scheduler in its failed state with ``error`` (a plugin's watchdog saw a
        reduction stuck beyond ``timeout_s``, say): every pending future fails with it, it
        is raised at the next call, and the other ranks are told. No-op once failed."""
        self._fail(error)

    def _bounds_of(self, tensor: Any) -> list[tuple[int, int]]:
        return self.bounds(int(self.ops.numel(tensor)), int(self.ops.element_size(tensor)))

    def _new_task(self, name: str, priority: int, on_done: Callable[[Task], None] | None, ready: Any) -> Task:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        task = Task(name=name, tensor=None, priority=int(priority), step=self._step, seq=self._seq, future=future,
                    on_done=on_done, submitted_us=now_us(), ready=ready)
        self._seq += 1
        self._submitted_in_step += 1
        self._stats["tasks"] += 1
        self._step_names[task.step].add(name)
        return task

    def _attach(self, task: Task, tensor: Any, bounds: list[tuple[int, int]]) -> None:
        """Cut ``tensor`` into the task's pieces and queue them (lock held)."""
        name, step = task.name, task.step
        if self._static and step >= 1 and self._plan is not None and any(
                f"{name}#{index}" not in self._plan_names for index in range(len(bounds))):
            raise OrderAgreementError(
                f"tensor {name!r} ({len(bounds)} pieces) does not match the static plan made in the profiling "
                "step (it is new there, or its size changed); ordering='static' needs the same tensors, of the "
                "same sizes, every step (use ordering='dynamic')")
        itemsize = int(self.ops.element_size(tensor))
        pieces = []
        for index, (lo, hi) in enumerate(bounds):
            pname = f"{name}#{index}"
            if (step, pname) in self._unissued:
                raise ValueError(f"tensor {name!r} was submitted twice in step {step} before its first "
                                 "submission started; names must be unique per step")
            pieces.append(Piece(task, index, lo, hi, (hi - lo) * itemsize, self.ops.flat_view(tensor, lo, hi), pname))
        task.tensor = tensor
        task.pieces = pieces
        task.remaining = len(pieces)
        self._pending[id(task)] = task
        if not pieces:  # zero-size: done at once
            self._completed.append(task)
            self._complete_cv.notify()
            return
        for piece in pieces:
            self._enqueue(piece)
        self._dispatch_cv.notify()

    def mark_step(self) -> int:
        """End the current step: every tensor of it has been submitted. Returns the new step.

        A step in which nothing was submitted is not counted. Under ``static``
        ordering this checks that the step communicated exactly the planned tensors.
        """
        with self._lock:
            self._check_usable()
            if self._submitted_in_step == 0:
                return self._step
            ended = self._step
            if self._static and ended >= 1 and self._plan is not None:
                planned = {n.rsplit("#", 1)[0] for n in self._plan}
                missing = sorted(planned - self._step_names.get(ended, set()))
                if missing:
                    exc = OrderAgreementError(
                        f"step {ended} communicated no gradient for {missing[:10]} although the static plan "
                        "expects it every step (an unused parameter?); use ordering='dynamic' for models "
                        "whose set of gradients changes between steps")
                    self._fail_locked(exc)
                    raise exc
            self._step_names.pop(ended - 2, None)
            self._step += 1
            self._submitted_in_step = 0
            self._stats["steps"] = self._step
            self._dispatch_cv.notify()
        self.timeline.instant(f"step {ended} end", step=ended)
        return self._step

    def wait(self, future: Future, timeout: float | None = None) -> Any:
        """Wait for ``future`` (from :meth:`submit`), at most ``timeout`` (default ``timeout_s``) seconds.

        Raises the task's error, another rank's abort as :class:`RemoteAbort`, or
        :class:`CommschedTimeout` listing the pieces still pending.
        """
        limit = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            self._raise_if_failed()
            left = deadline - time.monotonic()
            try:
                return future.result(timeout=max(0.0, min(_POLL_S, left)))
            except TimeoutError:
                if future.done():
                    continue
                self._check_remote_abort()
                if time.monotonic() >= deadline:
                    raise CommschedTimeout("waiting for a reduction", limit, self.pending()) from None

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every submitted tensor is reduced and its ``on_done`` ran.

        Raises like :meth:`wait`; never waits longer than ``timeout`` (default ``timeout_s``).
        """
        limit = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            while True:
                self._raise_if_failed_locked()
                if not self._pending:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommschedTimeout("synchronize()", limit, self._pending_names_locked())
                self._idle_cv.wait(min(_POLL_S, left))
                if self._pending:
                    self._lock.release()
                    try:
                        self._check_remote_abort()
                    finally:
                        self._lock.acquire()

    def check(self) -> None:
        """Raise now, without blocking, what a wait would raise: a background error,
        or another rank's abort (one store lookup)."""
        self._raise_if_failed()
        self._check_remote_abort()

    def pending(self) -> list[str]:
        """Names of the pieces not yet reduced (queued or in flight)."""
        with self._lock:
            return self._pending_names_locked()

    def stats(self) -> dict:
        """Counters: pieces and bytes started, tasks, steps, the most bytes ever in flight, credit,
        and per step the number of pieces, bytes and the order in which pieces started."""
        with self._lock:
            out = dict(self._stats)
            out["credit_bytes"] = self._credit
            out["partition_bytes"] = self.config.partition_bytes
            out["mode"] = self._mode
            out["ordering"] = self.config.ordering
            out["per_step"] = {s: {"pieces": v["pieces"], "bytes": v["bytes"], "order": list(v["order"])}
                               for s, v in self._step_stats.items()}
            return out

    def close(self, timeout: float | None = None) -> None:
        """Finish pending work (at most ``timeout`` seconds), stop and join every thread, write the timeline.

        Futures still pending then fail with :class:`SchedulerClosed`. Safe to call twice.
        A closed scheduler refuses new work.
        """
        if self._closed:
            return
        drain_error: BaseException | None = None
        if self._error is None:
            try:
                self.synchronize(timeout)
            except BaseException as exc:
                drain_error = exc
        with self._lock:
            self._closing = True
            self._dispatch_cv.notify_all()
            self._publish_cv.notify_all()
            self._complete_cv.notify_all()
        if self._mode == "follower" and self._store is not None:
            try:  # wake our own order reader, blocked in pop()
                self._store.push(self._key(f"q{self.rank}"), b"C")
            except Exception as exc:
                log.debug("could not wake the order reader: %r", exc)
        current = threading.current_thread()
        threads = self._threads + ([self._abort_thread] if self._abort_thread is not None else [])
        for thread in threads:
            if thread is not current:
                thread.join(timeout=max(5.0, 4 * _POLL_S))
                if thread.is_alive():
                    log.error("commsched thread %s did not stop", thread.name)
        try:
            self.backend.close()
        except Exception as exc:  # closing must go on; the engine may be broken already
            log.warning("closing the backend %s: %r", type(self.backend).__name__, exc)
        with self._lock:
            leftovers = list(self._pending.values())
            self._pending.clear()
            self._closed = True
            self._idle_cv.notify_all()
        for task in leftovers:
            if not task.future.done():
                task.future.set_exception(self._error or SchedulerClosed(
                    f"tensor {task.name!r} was still pending when the scheduler closed"))
        try:
            self.timeline.write()
        except OSError as exc:
            log.warning("could not write the timeline to %s: %s", self.timeline.path, exc)
        if drain_error is not None:
            raise drain_error

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            try:
                self.close(timeout=min(self.config.timeout_s, 5.0))
            except CommschedError:
                pass  # the exception already propagating says more

    # ------------------------------------------------------------- internals
    def _check_usable(self) -> None:
        if self._closed or self._closing:
            raise SchedulerClosed("this scheduler is closed; create a new one (or the optimizer that owns it)")
        self._raise_if_failed_locked()

    def _raise_if_failed(self) -> None:
        with self._lock:
            self._raise_if_failed_locked()

    def _raise_if_failed_locked(self) -> None:
        if self._error is not None:
            raise self._error

    def _pending_names_locked(self) -> list[str]:
        names = [f"{p.name} (in flight)" for p in self._in_flight.values()]
        names += [f"{p.name} (queued)" for _, p in sorted(self._unissued.items(), key=lambda kv: kv[1].key)]
        names += [f"{t.name} (waiting for data)" for t in self._waiting.values()]
        names += [f"{t.name} (waiting for an earlier ticket)" for t in self._reserved_order if id(t) in self._parked]
        names += [f"{t.name} (updating)" for t in self._pending.values() if t.remaining == 0
                  and self._waiting.get((t.step, t.name)) is not t and id(t) not in self._parked]
        return names

    def _enqueue(self, piece: Piece) -> None:
        self._unissued[(piece.task.step, piece.name)] = piece
        self._unissued_per_step[piece.task.step] += 1
        if self._mode in ("fifo", "immediate"):
            self._fifo.append(piece)
        elif self._mode in ("local", "leader") and not (self._static and piece.task.step >= 1):
            heapq.heappush(self._heap, (*piece.key, piece))

    def _credit_allows(self, nbytes: int) -> bool:
        return self._in_flight_bytes + nbytes <= self._credit or self._in_flight_bytes == 0

    # The one place where the next piece is chosen; called with the lock held.
    def _next_piece(self) -> Piece | None:
        mode = self._mode
        if mode == "immediate":
            return self._fifo.popleft() if self._fifo else None
        if mode == "fifo":
            if self._fifo and self._credit_allows(self._fifo[0].nbytes):
                return self._fifo.popleft()
            return None
        if self._static and self._plan is not None and self._plan_active():
            return self._next_from_plan()
        if mode in ("local", "leader"):
            if self._heap and self._credit_allows(self._heap[0][-1].nbytes):
                piece = heapq.heappop(self._heap)[-1]
                if self._observer is not None:
                    self._observer("issue", {"piece": piece, "key": piece.key,
                                             "waiting": [e[-1].key for e in self._heap],
                                             "in_flight_bytes": self._in_flight_bytes + piece.nbytes})
                return piece
            return None
        return self._next_agreed()

    def _plan_active(self) -> bool:
        # Step-0 pieces (the profiling step) still go by the dynamic protocol.
        return self._unissued_per_step.get(0, 0) == 0 and self._step >= 1

    def _next_from_plan(self) -> Piece | None:
        assert self._plan is not None
        if not self._plan:  # the profiling step communicated nothing (only zero-size tensors)
            return None
        name = self._plan[self._plan_pos]
        piece = self._unissued.get((self._plan_step, name))
        if piece is None:
            if (self._plan_step, name.rsplit("#", 1)[0]) in self._waiting:
                return None  # reserved, its data is not ready yet
            if self._step > self._plan_step:
                self._fail_locked(OrderAgreementError(
                    f"step {self._plan_step} communicated no gradient for {name.rsplit('#', 1)[0]!r} although "
                    "the static plan expects it every step (an unused parameter?); use ordering='dynamic'"))
            return None
        if not self._credit_allows(piece.nbytes):
            return None
        self._plan_pos += 1
        if self._plan_pos == len(self._plan):
            self._plan_pos = 0
            self._plan_step += 1
        return piece

    def _next_agreed(self) -> Piece | None:
        if not self._agreed and self._unissued and self._order_lost is not None:
            error = CommschedError(f"rank {self.rank} lost contact with rank 0's decisions (the store failed: "
                                   f"{self._order_lost!r}) while {len(self._unissued)} piece(s) wait to be sent")
            error.__cause__ = self._order_lost
            self._fail_locked(error)
            return None
        while self._agreed:
            entry = self._agreed[0]
            kind, step = entry[0], entry[1]
            if kind == "P":
                piece = self._unissued.get((step, entry[2]))
                if piece is None:
                    if (step, entry[2].rsplit("#", 1)[0]) in self._waiting:
                        return None  # reserved here, its data is not ready yet
                    if self._step > step:
                        self._fail_locked(OrderAgreementError(
                            f"rank 0 communicated {entry[2]!r} in step {step} but rank {self.rank} has no such "
                            "gradient in that step: every rank must produce the same gradients (an unused "
                            "parameter must be unused on every rank)"))
                    return None
                if not self._credit_allows(piece.nbytes):
                    return None
                self._agreed.popleft()
                return piece
            if self._step <= step:  # END or PLAN: wait until this rank has ended that step too
                return None
            if any(s == step for s, _ in self._waiting):
                return None  # a reserved tensor of that step may still be one rank 0 did not send
            extra = sorted(p.name for (s, _), p in self._unissued.items() if s == step)
            if extra:
                self._fail_locked(OrderAgreementError(
                    f"rank {self.rank} has gradients for {extra[:10]} in step {step} but rank 0 did not "
                    "communicate them: every rank must produce the same gradients (an unused parameter must "
                    "be unused on every rank)"))
                return None
            self._agreed.popleft()
            if kind == "L":
                self._set_plan(entry[2])
        return None

    def _set_plan(self, names: list[str]) -> None:
        self._plan = names
        self._plan_names = set(names)
        for piece in self._unissued.values():  # step>=1 pieces queued before the plan was known
            if piece.task.step >= 1 and piece.name not in self._plan_names:
                self._fail_locked(OrderAgreementError(
                    f"tensor {piece.task.name!r} was not communicated in the profiling step, so the static plan "
                    "has no place for it; use ordering='dynamic'"))

    def _maybe_end_steps(self) -> None:
        # Leader: announce the end of each finished step once all its pieces started.
        while self._end_sent_upto < self._step and self._unissued_per_step.get(self._end_sent_upto, 0) == 0:
            step = self._end_sent_upto
            self._end_sent_upto += 1
            if self._static and self._plan is not None:
                continue  # the plan fixes every later step and followers stopped reading: no per-step messages
            self._publish_buf.append(f"E\t{step}")
            if self._static and step == 0:
                self._plan = list(self._step0_order)
                self._plan_names = set(self._plan)
                self._publish_buf.append("L\t0\t" + "\x1f".join(self._plan))
            self._publish_cv.notify()

    def _mark_issued(self, piece: Piece) -> None:
        piece.issued = True
        piece.issued_us = now_us()
        step = piece.task.step
        del self._unissued[(step, piece.name)]
        self._unissued_per_step[step] -= 1
        if not self._unissued_per_step[step]:
            del self._unissued_per_step[step]
        self._in_flight[id(piece)] = piece
        self._in_flight_bytes += piece.nbytes
        stats = self._stats
        stats["pieces"] += 1
        stats["bytes"] += piece.nbytes
        if self._in_flight_bytes > stats["max_in_flight_bytes"]:
            stats["max_in_flight_bytes"] = self._in_flight_bytes
        per_step = self._step_stats.get(step)
        if per_step is None:
            per_step = self._step_stats[step] = {"pieces": 0, "bytes": 0, "order": []}
            self._step_stats.pop(step - 3, None)
        per_step["pieces"] += 1
        per_step["bytes"] += piece.nbytes
        per_step["order"].append(piece.name)
        if self._mode == "leader" and not (self._static and self._plan is not None and step >= 1):
            self._publish_buf.append(f"P\t{step}\t{piece.name}")
            if self._static and step == 0:
                self._step0_order.append(piece.name)
            self._publish_cv.notify()

    def _dispatch_loop(self) -> None:
        start_batch: list[Piece] = []
        while True:
            with self._lock:
                while True:
                    if self._closing or self._error is not None:
                        return
                    had_plan = self._plan is not None
                    piece = self._next_piece()
                    while piece is not None:
                        self._mark_issued(piece)
                        start_batch.append(piece)
                        piece = self._next_piece()
                    if self._mode == "leader":
                        self._maybe_end_steps()
                    if self._plan is not None and not had_plan:
                        continue  # the static plan just started (made here, or read from rank 0): look again
                    if start_batch or self._error is not None:
                        break
                    self._dispatch_cv.wait()
            for piece in start_batch:
                done = self._make_done(piece)
                try:
                    self.backend.start(piece, done)
                except BaseException as exc:
                    done(exc)
            start_batch.clear()

    def _make_done(self, piece: Piece) -> Callable[[Optional[BaseException]], None]:
        def done(exc: Optional[BaseException] = None) -> None:
            self._on_piece_done(piece, exc)
        return done

    def _on_piece_done(self, piece: Piece, exc: Optional[BaseException]) -> None:
        if self._closed:  # a late completion: close() already failed the futures and joined our threads
            return
        end = now_us()
        remote = self._remote_abort_message(grace_s=1.0) if exc is not None else None
        with self._lock:
            if piece.done:
                log.error("piece %s completed twice; the engine called done() again (ignored)", piece.name)
                return
            piece.done = True
            self._in_flight.pop(id(piece), None)
            self._in_flight_bytes -= piece.nbytes
            task = piece.task
            if remote is not None:  # the engine failed because another rank stopped: say why it stopped
                error = RemoteAbort(f"another rank failed, so this one stops too: {remote}")
                error.__cause__ = exc
                self._fail_locked(error)
            elif exc is not None:
                error = CommunicationError(
                    f"reducing tensor {task.name!r} (piece {piece.index}, elements {piece.start}:{piece.stop}) "
                    f"failed on rank {self.rank}: {exc}", tensor=task.name, piece=piece.index)
                error.__cause__ = exc
                self._fail_locked(error)
            else:
                task.remaining -= 1
                if task.remaining == 0:
                    self._completed.append(task)
                    self._complete_cv.notify()
            self._dispatch_cv.notify()
        if self.timeline.enabled:
            self.timeline.span("QUEUED", piece.name, piece.task.submitted_us, piece.issued_us, step=piece.task.step)
            self.timeline.span("COMM", piece.name, piece.issued_us, end, bytes=piece.nbytes, step=piece.task.step)

    def _complete_loop(self) -> None:
        while True:
            with self._lock:
                while not self._completed and not self._failing:
                    if self._closing:
                        return
                    self._complete_cv.wait()
                if self._failing:
                    failing, self._failing = self._failing, []
                    error = self._error
                else:
                    failing = []
                    task = self._completed.popleft()
                    skip = self._error is not None
            if failing:
                for task in failing:
                    if not task.future.done():
                        task.future.set_exception(error)
                continue
            error = None
            if task.on_done is not None and not skip:
                try:
                    task.on_done(task)
                except BaseException as exc:
                    error = CommschedError(f"the update after reducing tensor {task.name!r} failed: {exc!r}")
                    error.__cause__ = exc
            with self._lock:
                self._pending.pop(id(task), None)
                if error is not None:
                    self._fail_locked(error)
                if not self._pending:
                    self._idle_cv.notify_all()
            if not task.future.done():
                if error is None:
                    task.future.set_result(task.tensor)
                else:
                    task.future.set_exception(error)

    # ---------------------------------------------------- order agreement I/O
    def _key(self, what: str) -> str:
        return f"{self._prefix}/{what}"

    def _publish_loop(self) -> None:
        store = self._store
        assert store is not None
        while True:
            with self._lock:
                while not self._publish_buf and not self._closing:
                    self._publish_cv.wait()
                if not self._publish_buf and self._closing:
                    return
                lines = self._publish_buf
                self._publish_buf = []
            # One queue per follower: a pop removes what was read, so nothing accumulates.
            payload = "\n".join(lines).encode()
            for rank in range(1, self.world_size):
                store.push(self._key(f"q{rank}"), payload)

    def _order_loop(self) -> None:
        store = self._store
        assert store is not None
        queue = self._key(f"q{self.rank}")
        while True:
            with self._lock:
                if self._closing or self._error is not None:
                    return
                if self._plan is not None:
                    return  # static: nothing more is published
            try:
                raw = store.pop(queue, self.config.timeout_s)
            except TimeoutError:
                continue  # idle (evaluation, say); waits of the user's thread have their own timeouts
            except Exception as exc:  # the store went away (process group destroyed, rank 0 gone)
                # Not an error yet: rank 0 may simply have finished first. It becomes one
                # if this rank still has pieces waiting for rank 0's decisions.
                with self._lock:
                    self._order_lost = exc
                    self._dispatch_cv.notify()
                return
            text = raw.decode()
            if text == "C":  # this rank's own close() woke us
                return
            if text.startswith("A\t"):  # another rank failed
                self._fail(RemoteAbort(f"another rank failed, so this one stops too: {text[2:]}"))
                return
            entries = []
            for line in text.split("\n"):
                kind, step, rest = (line.split("\t", 2) + ["", ""])[:3]
                if kind == "L":
                    entries.append(("L", int(step), rest.split("\x1f") if rest else []))
                else:
                    entries.append((kind, int(step), rest))
            with self._lock:
                self._agreed.extend(entries)
                self._dispatch_cv.notify()
                if any(e[0] == "L" for e in entries):
                    return

    # ------------------------------------------------------------- failures
    def _fail(self, error: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None and error.__cause__ is None:
            error.__cause__ = cause
        with self._lock:
            self._fail_locked(error)

    def _fail_locked(self, error: BaseException) -> None:
        """Enter the failed state: remember ``error``, fail every pending future, tell the other ranks."""
        if self._error is not None:
            return
        self._error = error
        # Futures fail on the completion thread: never run user callbacks under our lock.
        self._failing.extend(t for t in self._pending.values() if not t.future.done())
        for notify in (self._dispatch_cv, self._complete_cv, self._publish_cv, self._idle_cv):
            notify.notify_all()
        if self._store is not None and self.world_size > 1 and not isinstance(error, RemoteAbort):
            self._abort_thread = threading.Thread(target=self._publish_abort, args=(error,),
                                                  name=f"commsched-abort-r{self.rank}", daemon=False)
            self._abort_thread.start()

    def _publish_abort(self, error: BaseException) -> None:
        message = f"rank {self.rank}: {error}"
        try:
            assert self._store is not None
            self._store.set(self._key("abort"), message.encode())
            if self._mode in ("leader", "follower"):  # wake the other ranks' order readers
                for rank in range(1, self.world_size):
                    if rank != self.rank:
                        self._store.push(self._key(f"q{rank}"), f"A\t{message}".encode())
        except Exception as exc:  # best effort: the store may be gone too
            log.debug("could not publish the abort: %r", exc)

    def _remote_abort_message(self, grace_s: float = 0.0) -> str | None:
        """Another rank's abort message, waiting up to ``grace_s`` for it to arrive."""
        store = self._store
        if store is None or self.world_size <= 1:
            return None
        deadline = time.monotonic() + grace_s
        try:
            while not store.check(self._key("abort")):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)  # failure path only: the other rank is publishing why it stopped
            return store.get(self._key("abort"), 1.0).decode()
        except Exception:
            return None

    def _check_remote_abort(self, background: bool = False) -> None:
        message = self._remote_abort_message()
        if message is None:
            return
        error = RemoteAbort(f"another rank failed, so this one stops too: {message}")
        with self._lock:
            if self._error is None:
                self._fail_locked(error)
        if not background:
            self._raise_if_failed()
