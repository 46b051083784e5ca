"""The scheduler: the user API, and the threads around one lock-owned state.

Data flows down (``submit`` → pieces → ``Backend.start``), completions flow up
(``done`` → future → the plugin's ``on_done``). The next piece is the dispatch
policy's choice (:mod:`commsched.policy`); the state and its changes are
:mod:`commsched.state`; rank 0's decisions travel by :mod:`commsched.protocol`;
failures are named in :mod:`commsched.failures`. Threads (named, non-daemon, joined
by ``close()``): ``submit`` starts what the policy allows at once, on the caller's thread, and
``dispatch`` what completions and decisions release later (on an engine that runs collectives
in issue order, both issue under one issue lock, so the engine sees the decided order); ``complete`` resolves
futures and runs ``on_done`` (engine threads never run user code); ``publish`` (rank
0) and ``order`` (the others) carry decisions under ``dynamic``/``static``.

Invariants (tested in ``tests/core``):

1. bytes in flight ≤ ``credit_bytes``, except that one piece larger than the
   credit may go alone when nothing else is in flight;
2. among ready pieces the deciding rank starts the most urgent first: the
   smallest ``(step, priority)``, ties in submission order;
3. with ``dynamic`` and ``static`` every rank starts exactly the same sequence of
   pieces; every submitted piece is started exactly once and completed at most once;
4. every future resolves, with a result or an exception; an exception on a
   background thread surfaces at the next call of the user's thread, and no wait
   is longer than ``timeout_s``.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional

from commsched import failures
from commsched.config import SchedulerConfig
from commsched.errors import CommschedError, CommschedTimeout, SchedulerClosed
from commsched.lifecycle import Closeable, close_at_exit, join_threads, lower_priority
from commsched.partition import TensorOps
from commsched.policy import make_policy
from commsched.protocol import Channel, Message, publish_loop, read_loop
from commsched.state import SchedulerState
from commsched.store import Store
from commsched.task import Backend, Piece, Task, Ticket, check_name
from commsched.timeline import Timeline, now_us

__all__ = ["Backend", "Piece", "Scheduler", "Task", "Ticket"]

log = logging.getLogger(__name__)

_POLL_S = 0.25  # how often a blocked wait looks for another rank's abort
#: The largest piece :meth:`Scheduler.submit` launches on the submitting (training) thread; bigger
#: ones go to the dispatch thread, which launches them beside backward.
INLINE_MAX_BYTES = 1 << 20
#: The CPU counts of ``stats()`` that would cost a clock read per piece (a piece's completion on the
#: engine's thread, its ``on_piece``, a launch from the dispatch thread or a completion) are taken on one
#: piece or batch in this many, drawn at random, and scaled up by it: ``time.thread_time()`` is a system
#: call (0.7 us uncontended here, several under load), and two a piece were a tenth of the scheduler's
#: own cost in ``commsched.bench.overhead``. Random, not every n-th, so a step's fixed order of pieces
#: cannot alias with it. 1: every piece timed.
CPU_SAMPLE_EVERY = 8


class Scheduler(Closeable):
    """Schedules the reduction of submitted tensors on one rank.

    Args:
        backend: the collective engine (see :class:`Backend`).
        ops: the framework's tensor operations (see :class:`~commsched.partition.TensorOps`).
        config: a :class:`~commsched.config.SchedulerConfig` (default: from the environment).
        store: the rendezvous store shared by all ranks; required with more than one rank
            for ``dynamic`` and ``static`` ordering on engines that do not negotiate order.
        key_prefix: namespace of this scheduler's keys in the store; the same on every
            rank, different between schedulers sharing a store.
        observer: called with ``(piece, queued_keys, in_flight_bytes)`` under the lock each
            time this rank decides to start a piece (tests, tracing); must be quick and must
            not call the scheduler.
        timeline: a :class:`~commsched.timeline.Timeline` to record into (default: a new one from
            ``config.timeline``); a plugin that replaces its scheduler at an agreed step boundary
            passes the first one on, so one file has the whole run.

    Priorities: smaller is more urgent (0 is what the next forward needs first). Call
    :meth:`mark_step` once per step, after the step's last submit: ranks check agreement there.
    """

    def __init__(self, backend: Backend, ops: TensorOps, config: SchedulerConfig | None = None, *,
                 store: Store | None = None, key_prefix: str = "commsched",
                 observer: Callable[[Piece, list, int], None] | None = None,
                 timeline: Timeline | None = None) -> None:
        self.config = config if config is not None else SchedulerConfig()
        self.backend, self.ops = backend, ops
        self.rank, self.world_size = int(backend.rank), int(backend.world_size)
        policy = make_policy(self.config, self.rank, self.world_size, bool(backend.negotiates_order))
        if (policy.publishes or policy.reads_decisions) and store is None:
            raise ValueError(
                f"ordering={self.config.ordering!r} with {self.world_size} ranks needs a store to agree on order; "
                "pass store=... (the plugin does this), or use ordering='fifo' only on an engine that agrees on "
                "order itself")
        self._channel = Channel(store, key_prefix, self.rank, self.world_size) if store is not None else None
        self._state = SchedulerState(policy, ops, self.config.partition_bytes, self._channel, self.rank, observer)
        self.timeline = timeline if timeline is not None else Timeline(self.config.timeline, self.rank, self.world_size)
        self._lock = threading.Lock()
        self._dispatch_cv, self._complete_cv, self._publish_cv, self._idle_cv = (
            threading.Condition(self._lock) for _ in range(4))
        self._closing = self._closed = False
        # submit() starts what the policy allows right away, on the caller's thread (pieces up to
        # INLINE_MAX_BYTES; bigger ones go through ``_handoff``), and the dispatch
        # thread only starts what completions and decisions release later: one thread hop less per
        # piece (on 2 busy cores the hop cost more than the piece; docs/ARCHITECTURE.md). gloo and NCCL
        # match collectives by issue order, so deciding and starting happen together under
        # ``_issue_lock`` (taken before ``_lock``, never while waiting) on every engine: one mechanism,
        # harmless where the engine negotiates order itself (Horovod). The dispatch thread sleeps only
        # while ``_work_gen`` says nothing changed since it decided.
        self._issue_lock = threading.Lock()
        # Pieces decided on a submitting thread but too big to launch there (the engine's launch of a
        # large piece on the training thread delays backward; INLINE_MAX_BYTES): the dispatch thread
        # starts them first, before anything decided after them.
        self._handoff: list[Piece] = []
        # CPU seconds commsched's own threads spent in the engine's work rather than in scheduling: the
        # engine's launch in backend.start() (written under the issue lock, by whichever thread issues), the
        # completion thread in on_done and the engine's thread in on_piece (the plugin's averaging; on_piece
        # written under _counter_lock). stats()["engine_cpu_s"].
        self._engine_cpu = {"launch": 0.0, "on_done": 0.0, "on_piece": 0.0}
        # ``SchedulerConfig.direct_start``: a completion starts what its credit freed on the engine's own
        # thread where the engine allows it (``Backend.starts_in_done``), and the order thread what a
        # delivered message allows: no wake-up of the dispatch thread. ``_callback_cpu``: CPU seconds of
        # completions run on threads that are not commsched's (gloo's), which the bench's per-thread count
        # cannot see; ``_started_direct``: pieces started on a completion's or on the order thread.
        self._direct_start = bool(self.config.direct_start)
        self._callback_cpu = 0.0
        self._started_direct = {"on_done": 0, "on_delivery": 0}
        self._counter_lock = threading.Lock()
        # draws which completions and launches are timed (CPU_SAMPLE_EVERY); seeded: runs repeat
        self._cpu_sampler = random.Random(0x5EED).random
        self._cpu_every = CPU_SAMPLE_EVERY
        self._cpu_share = 1.0 / CPU_SAMPLE_EVERY
        self._work_gen = 0  # bumped (lock held) whenever the dispatch thread may have new work
        self._published_batches = 0  # rank 0: batches of messages pushed to the followers (stats())
        self._threads: list[threading.Thread] = []
        self._spawn("dispatch", self._dispatch_loop)
        self._spawn("complete", self._complete_loop)
        # rank 0 publishes decisions and (ready_reports) reads the followers' reports; a follower reads
        # decisions and publishes its reports
        if policy.publishes or policy.reports_ready:
            self._spawn("publish", lambda: publish_loop(self._channel, self._next_outbox))
        self._reads = bool(policy.reads_decisions or policy.reads_reports)
        if self._reads:
            self._spawn("order", lambda: read_loop(self._channel, self.config.timeout_s, self._reading,
                                                   self._deliver, lambda m: self._fail(failures.remote_abort(m))))
        close_at_exit(self, min(self.config.timeout_s, 10.0))

    def _spawn(self, what: str, target: Callable[[], None]) -> None:
        def run() -> None:
            lower_priority(self.config.thread_nice)  # the training thread gets a busy core first
            try:
                target()
            except BaseException as exc:  # a bug or engine failure on a background thread
                log.exception("commsched background thread failed")
                self._fail(failures.background_failed(threading.current_thread().name, exc))
        thread = threading.Thread(target=run, name=f"commsched-{what}-r{self.rank}", daemon=False)
        self._threads.append(thread)
        thread.start()

    # --------------------------------------------------------------- user API
    @property
    def mode(self) -> str:
        """How this rank decides order: local, leader, follower, fifo or immediate."""
        return self._state.policy.mode

    @property
    def error(self) -> BaseException | None:
        """The error that put this scheduler in its failed state, or None while it is healthy."""
        return self._state.error

    @property
    def step(self) -> int:
        """The current step number (advanced by :meth:`mark_step`)."""
        return self._state.step

    def submit(self, name: str, tensor: Any, priority: int = 0,
               on_done: Callable[[Task], None] | None = None, *, ready: Any = None,
               on_piece: Callable[[Piece], None] | None = None) -> Future:
        """Queue ``tensor`` for an in-place reduction; returns a future of ``tensor``.

        ``name``: the same on every rank, unique among unfinished tasks. ``on_done(task)`` runs on
        the completion thread once every piece is reduced, before the future resolves; what it
        raises fails the future and the next call. ``ready`` becomes ``task.ready`` (:class:`Task`).
        ``on_piece(piece)`` runs on the engine's thread as each piece lands, before that piece
        counts as landed (so before the future resolves): a plugin that uses each reduced range
        at once (the torch plugin's update of a range while its forward waits for the rest). It
        must be short; what it raises fails the piece.
        """
        check_name(name)
        try:
            bounds = self._state.bounds_of(name, tensor)
        except CommschedError as exc:  # the plan has no place for it: every rank must hear of it
            self._fail(exc)
            raise
        with self._issue_lock:  # decided and started in one order, whichever thread issues next
            with self._lock:
                task, batch = self._submit_locked(name, priority, on_done, ready, tensor, bounds, on_piece)
                if batch and (self._handoff or any(p.nbytes > INLINE_MAX_BYTES for p in batch)):
                    self._handoff += batch  # after what is handed off already: the decided order
                    batch = []
                    self._poke_dispatch()
            self._start(batch)
        return task.future

    def _submit_locked(self, name: str, priority: int, on_done: Callable[[Task], None] | None, ready: Any,
                       tensor: Any, bounds: Any,
                       on_piece: Callable[[Piece], None] | None = None) -> tuple[Task, list[Piece]]:
        self._check_usable()
        task = self._state.submit(name, priority, on_done, ready, tensor, bounds)
        task.on_piece = on_piece  # before any of its pieces can start (the lock is held)
        batch = self._decide_locked()
        if self._state.completed:  # a zero-size tensor is done at once
            self._complete_cv.notify()
        if not batch:  # nothing fits now: the dispatch thread starts it when credit or a decision allows
            self._poke_dispatch()
        return task, batch

    def reserve(self, name: str, priority: int = 0, on_done: Callable[[Task], None] | None = None) -> Ticket:
        """Announce a tensor of the current step whose data is not ready yet (an engine writes it).

        :meth:`synchronize` and :meth:`pending` count it from now on, and order agreement
        waits for it rather than calling it missing. With ``ordering="fifo"`` tickets are
        submitted in reservation order (a ticket ready early waits for earlier ones), so
        every rank issues in its user thread's order; otherwise each goes once ready.
        """
        check_name(name)
        with self._lock:
            self._check_usable()
            return Ticket(self, self._state.reserve(name, priority, on_done))

    def bounds(self, numel: int, element_size: int, name: str | None = None) -> list[tuple[int, int]]:
        """The ``[start, stop)`` element ranges :meth:`submit` cuts a tensor of that size (called ``name``)
        into, computed once per size: a plugin that names pieces in advance (MXNet's sub-keys) agrees
        with it. Under ``ordering="planned"`` pass ``name``: the plan cuts each group at its own size."""
        return self._state.bounds(numel, element_size, name)

    def mark_step(self) -> int:
        """End the current step (all its tensors were submitted); returns the new step. An empty step
        does not count. The policy checks the step (``static``: exactly the planned tensors)."""
        with self._lock:
            self._check_usable()
            if self._state.submitted_in_step == 0:
                return self._state.step
            try:
                ended = self._state.end_step()  # the policy may refuse the step: that fails the state
            finally:
                self._wake_all()
        self.timeline.instant(f"step {ended} end", step=ended)
        return ended + 1

    def wait(self, future: Future, timeout: float | None = None) -> Any:
        """Wait for ``future`` (from :meth:`submit`), at most ``timeout`` (default ``timeout_s``) seconds.

        Raises the task's error, another rank's abort as :class:`RemoteAbort`, or
        :class:`CommschedTimeout` listing the pieces still pending.
        """
        limit = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            self._state.raise_if_failed()
            try:
                return future.result(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
            except TimeoutError:
                if future.done():
                    continue
                self.check()  # one store lookup per poll, never on the fast path
                if time.monotonic() >= deadline:
                    raise CommschedTimeout("waiting for a reduction", limit, self.pending()) from None

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every submitted or reserved tensor is reduced and its ``on_done`` ran.

        Raises like :meth:`wait`; never waits longer than ``timeout`` (default ``timeout_s``).
        """
        limit = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            with self._lock:
                self._state.raise_if_failed()
                if not self._state.pending:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommschedTimeout("synchronize()", limit, self._state.describe())
                self._idle_cv.wait(min(_POLL_S, left))
                if not self._state.pending:
                    continue
            self.check()

    def check(self) -> None:
        """Raise now what a wait would raise: a background error, or another rank's abort (one lookup)."""
        self._state.raise_if_failed()
        message = self._channel.abort_message() if self._channel is not None and self.world_size > 1 else None
        if message is not None:
            self._fail(failures.remote_abort(message))
            self._state.raise_if_failed()

    def abort(self, error: BaseException) -> None:
        """Enter the failed state with ``error`` (a plugin's watchdog saw a reduction stuck
        beyond ``timeout_s``, say): every pending future fails with it, it is raised at the
        next call, and the other ranks are told. No-op once failed."""
        self._fail(error)

    def pending(self) -> list[str]:
        """Names of what is not reduced yet: pieces in flight or queued, tensors waiting for data."""
        with self._lock:
            return self._state.describe()

    def stats(self) -> dict:
        """Pieces and bytes started, tasks, steps, the most bytes in flight, settings; per step: pieces,
        bytes, start order; ``engine_cpu_s``: CPU seconds so far of the dispatch thread in the engine's
        launches (``launch``; with ``direct_start`` also the launches on the engine's completion thread
        and the order thread), of the completion thread in ``on_done`` (the plugin's averaging) and of
        the engine's thread in a task's ``on_piece`` (the plugin's averaging of each range as it lands,
        ``on_piece``); ``callback_cpu_s``: CPU
        seconds of piece completions run on the engine's own threads (gloo's: not a ``commsched-*``
        thread, so a per-thread count misses them), launches there included; ``started_direct``: pieces
        a completion started on the engine's thread (``on_done``) and the order thread started on a
        delivered decision or report (``on_delivery``) (``SchedulerConfig.direct_start``).
        Rank 0 under ``dynamic``/``static``: ``published_batches`` (messages pushed to the followers,
        in how many batches) and ``decided_ahead`` (pieces published before they started,
        ``SchedulerConfig.decide_ahead``); with ``ready_reports`` under ``dynamic``, ``held_for_reports``
        (pieces ready here that waited for a follower's report) and ``started_before_reports`` (of those,
        started on an idle link before every report came)."""
        with self._lock:
            out = dict(self._state.counters.snapshot(), steps=self._state.step, mode=self.mode,
                       credit_bytes=self.config.credit_bytes, partition_bytes=self.config.partition_bytes,
                       ordering=self.config.ordering, direct_start=self._direct_start,
                       engine_cpu_s=dict(self._engine_cpu),
                       callback_cpu_s=self._callback_cpu, started_direct=dict(self._started_direct))
            if self._state.policy.publishes:  # rank 0 under dynamic/static: how its decisions travelled
                deciding = getattr(self._state.policy, "inner", self._state.policy)  # planned wraps the leader
                out.update(published_batches=self._published_batches,
                           decided_ahead=int(getattr(deciding, "ahead_total", 0)))
                if getattr(deciding, "followers", 0):  # ready_reports: pieces that waited for a follower
                    out.update(held_for_reports=int(deciding.held_total),
                               started_before_reports=int(deciding.forced_total))
            plan = getattr(self._state.policy, "plan", None)
            if plan is not None and hasattr(plan, "digest"):  # planned: the plan's credit, piece sizes, digest
                sizes = sorted({g.partition_bytes for g in plan.groups})
                out.update(credit_bytes=plan.credit_bytes, plan_digest=plan.digest,
                           partition_bytes=sizes[-1] if sizes else self.config.partition_bytes,
                           partition_bytes_per_group={g.name: g.partition_bytes for g in plan.groups})
            return out

    def close(self, timeout: float | None = None) -> None:
        """Finish pending work (at most ``timeout`` seconds), stop and join every thread, close the
        backend, write the timeline. Futures still pending then fail with :class:`SchedulerClosed`.
        Safe to call twice; a closed scheduler refuses new work."""
        if self._closed:
            return
        drain_error: BaseException | None = None
        if self._state.error is None:
            try:
                self.synchronize(timeout)
            except BaseException as exc:
                drain_error = exc
        with self._lock:
            self._closing = True
            self._wake_all()
        if self._reads and self._channel is not None:
            self._channel.wake()
        join_threads(self._threads + self._state.failed.threads(), timeout_s=max(5.0, 4 * _POLL_S))
        if self._channel is not None:
            self._channel.close()  # the last rank to close deletes the channel's keys
        try:
            self.backend.close()
        except Exception as exc:  # closing goes on; the engine may be broken already
            log.warning("closing the backend %s: %r", type(self.backend).__name__, exc)
        with self._lock:
            leftovers, self._state.pending = list(self._state.pending.values()), {}
            self._closed = True
            self._idle_cv.notify_all()
        for task in leftovers:
            if not task.future.done():
                task.future.set_exception(self._state.error or SchedulerClosed(
                    f"tensor {task.name!r} was still pending when the scheduler closed"))
        self.timeline.write_or_warn()
        if drain_error is not None:
            raise drain_error

    # ------------------------------------------------------------- internals
    def _check_usable(self) -> None:
        if self._closed or self._closing:
            raise SchedulerClosed("this scheduler is closed; create a new one (or the optimizer that owns it)")
        self._state.raise_if_failed()

    def _wake_for_new_work(self) -> None:
        if self._state.completed:  # a zero-size tensor is done at once
            self._complete_cv.notify()
        if self._state.outbox:  # a follower's ready report (ready_reports): rank 0 decides on it
            self._publish_cv.notify()
        self._poke_dispatch()

    def _poke_dispatch(self) -> None:
        """Tell the dispatch thread (lock held) that the policy may start something now."""
        self._work_gen += 1
        self._dispatch_cv.notify()

    def _ticket_ready(self, task: Task, tensor: Any) -> None:
        with self._lock:
            if self._closed or self._state.error is not None:
                return  # its future has failed already
            try:
                self._state.arrived(task, tensor, self._state.bounds_of(task.name, tensor))
            except BaseException as exc:  # refused (bad data, the plan): fail, never raise on an engine thread
                self._fail_locked(failures.refused(task.name, exc))
            self._wake_for_new_work()

    def _decide_locked(self) -> list[Piece]:
        """The pieces the policy starts now (lock held); wakes whoever its outcome concerns."""
        batch = self._state.decide()
        if self._state.error is not None:
            self._wake_all()
        if self._state.outbox:
            self._publish_cv.notify()
        return batch

    def _next_batch_locked(self) -> list[Piece]:
        """What to start now (both locks held): the pieces handed over earlier first, in their decided order,
        then whatever the policy decides now."""
        handoff, self._handoff = self._handoff, []
        return handoff + self._decide_locked()

    def _start(self, batch: list[Piece], timed: bool = False) -> None:
        """Hand ``batch`` to the engine (lock not held); a piece the engine refuses completes with its error.
        ``timed`` (the dispatch thread): its CPU time counts as ``engine_cpu_s["launch"]`` (one batch in
        :data:`CPU_SAMPLE_EVERY` is timed, scaled up)."""
        timed = timed and self._cpu_sampler() < self._cpu_share
        t0 = time.thread_time() if timed else 0.0
        for piece in batch:
            done = functools.partial(self._on_piece_done, piece)
            try:
                self.backend.start(piece, done)
            except BaseException as exc:
                done(exc)
        if timed:
            self._engine_cpu["launch"] += (time.thread_time() - t0) * self._cpu_every

    def _dispatch_loop(self) -> None:
        while True:
            with self._issue_lock:
                with self._lock:
                    if self._closing or self._state.error is not None:
                        return
                    seen = self._work_gen
                    batch = self._next_batch_locked()
                if batch:
                    self._start(batch, timed=True)
                    continue
            with self._lock:  # sleep until something changed since that decision (no lost wake-up)
                while self._work_gen == seen and not self._closing and self._state.error is None:
                    self._dispatch_cv.wait()

    def _on_piece_done(self, piece: Piece, exc: Optional[BaseException]) -> None:
        if self._closed:  # a late completion: close() already failed the futures and joined our threads
            return
        # CPU_SAMPLE_EVERY: one completion in that many is timed (a clock read is a system call)
        timed = self._cpu_sampler() < self._cpu_share
        t0 = time.thread_time() if timed else 0.0
        timeline = self.timeline if self.timeline.enabled else None  # no clock read for a timeline that is off
        end = now_us() if timeline is not None else 0.0
        remote = None
        plugin_s = 0.0
        if exc is None and piece.task.on_piece is not None and not piece.done:
            try:
                piece.task.on_piece(piece)
            except BaseException as raised:  # the plugin's use of the range failed: so did the piece
                exc = raised
            if timed:
                plugin_s = time.thread_time() - t0
        if exc is not None and self._channel is not None and self.world_size > 1:
            remote = self._channel.abort_message(grace_s=1.0)  # did another rank say why it stopped?
        with self._lock:
            if self._state.landed(piece, exc, remote):
                self._complete_cv.notify()
            if exc is not None:
                self._wake_all()
            # The credit this frees matters only to pieces that wait to start: with none, waking the
            # dispatch thread (a wake-up, both locks and a decision of nothing, per piece) is pure cost.
            waiting = bool(len(self._state.unstarted) or self._handoff)
            if waiting and (exc is not None or not self._direct_start
                            or not getattr(self.backend, "starts_in_done", False)):
                self._poke_dispatch()
                waiting = False
        if waiting:
            self._start_freed("on_done")
        if timeline is not None:
            timeline.piece(piece, end)
        if timed:
            ours = threading.current_thread().name.startswith("commsched-")  # else the engine's thread (gloo's)
            spent = 0.0 if ours else time.thread_time() - t0
            with self._counter_lock:  # gloo runs completions on more than one thread
                self._callback_cpu += spent * self._cpu_every
                self._engine_cpu["on_piece"] += plugin_s * self._cpu_every

    def _start_freed(self, where: str) -> None:
        """On the engine's completion thread (``where="on_done"``) or the order thread (``"on_delivery"``)
        under ``direct_start``: decide and start what a landing or a delivered message freed, as the
        dispatch thread would, without waking it. Never waits for the issue lock: whoever holds it
        is issuing (the dispatch thread decides again after its launch, a submit does not), so the
        dispatch thread is poked instead. A piece the engine completes inside ``start`` comes back here
        with the lock held by this thread and pokes too: no recursion, no deadlock."""
        if not self._issue_lock.acquire(blocking=False):
            with self._lock:
                self._poke_dispatch()
            return
        try:
            with self._lock:
                if self._closing or self._state.error is not None:
                    return
                batch = self._next_batch_locked()
                self._started_direct[where] += len(batch)
            if batch:
                self._start(batch, timed=True)
        finally:
            self._issue_lock.release()

    def _complete_loop(self) -> None:
        state = self._state
        while True:
            with self._lock:
                while not state.completed and not state.failing:
                    if self._closing:
                        return
                    self._complete_cv.wait()
                failing, task = state.next_completion()
            for each in failing:  # outside the lock: callbacks of the futures run here
                if not each.future.done():
                    each.future.set_exception(state.error)
            if task is None:
                continue
            error = None
            if task.on_done is not None and state.error is None:
                t0 = time.thread_time()
                try:
                    task.on_done(task)
                except BaseException as exc:
                    error = failures.update_failed(task.name, exc)
                self._engine_cpu["on_done"] += time.thread_time() - t0
            with self._lock:
                if state.finished(task, error):
                    self._wake_all()
                if not state.pending:
                    self._idle_cv.notify_all()
            if not task.future.done():
                if error is not None:
                    task.future.set_exception(error)
                else:
                    task.future.set_result(task.tensor)

    # ---------------------------------------------------- order agreement I/O
    def _next_outbox(self) -> list[Message] | None:
        with self._lock:
            while not self._state.outbox and not self._closing:
                self._publish_cv.wait()
            batch, self._state.outbox = self._state.outbox, []
            self._published_batches += bool(batch)
            return batch or None

    def _reading(self) -> bool:
        with self._lock:
            return not (self._closing or self._state.error is not None or self._state.policy.done_reading)

    def _deliver(self, messages: list[Message]) -> None:
        with self._lock:
            self._state.policy.receive(messages)
            if not self._direct_start:
                self._poke_dispatch()
                return
        self._start_freed("on_delivery")

    # ------------------------------------------------------------- failures
    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._fail_locked(error)

    def _fail_locked(self, error: BaseException) -> None:
        """The one way into the failed state: keep ``error``, fail every pending future, tell the other ranks."""
        if self._state.fail(error):
            self._wake_all()

    def _wake_all(self) -> None:
        """Every thread must see the failed state (and the completion thread fail the futures)."""
        self._work_gen += 1
        for cv in (self._dispatch_cv, self._complete_cv, self._publish_cv, self._idle_cv):
            cv.notify_all()

