"""Dispatch policies: which ready piece starts next. Pure objects, no threads, no clock.

A policy sees the pieces that are ready on this rank (:class:`Unstarted`) and the
bytes in flight, and names the piece to start now, or None. The
:class:`~commsched.scheduler.Scheduler` calls it under its lock; a simulator can
drive the very same objects with a simulated clock. One class per rule, chosen
once by :func:`make_policy`:

==========================  =========================================================
policy                      rule
==========================  =========================================================
:class:`PriorityPolicy`     smallest ``(step, priority, seq, index)`` within the credit
                            (one rank; or rank 0 on an engine that negotiates order)
:class:`LeaderPolicy`       the same, and every decision is published (``dynamic``)
:class:`FollowerPolicy`     exactly rank 0's published sequence, each piece once it is
                            ready here and fits the credit
:class:`StaticLeader`,      step 0 (or the ``record_step``) as leader/follower; then every
:class:`StaticFollower`     step repeats that step's order (the plan), with no messages
:class:`PlannedPolicy`      the plan's fixed piece order within the plan's credit, from
                            step 0 on every rank, with no messages (``planned``)
:class:`FifoPolicy`         submission order within the credit (``fifo``)
:class:`ImmediatePolicy`    submission order, no credit (ranks > 0 on Horovod, whose
                            coordinator orders by name: credit there could deadlock it)
==========================  =========================================================

Credit: a piece may start if ``in_flight + size <= credit``, or alone when nothing is
in flight. A policy raises :class:`~commsched.errors.OrderAgreementError` when ranks
disagree; the scheduler then fails.
"""

from __future__ import annotations

import collections
import heapq
from typing import Any, Callable, NamedTuple, Sequence

from commsched.config import SchedulerConfig
from commsched.errors import CommschedError, OrderAgreementError
from commsched.partition import piece_bounds
from commsched.plan import OBSERVED_STEP
from commsched.plan import Plan as CommPlan
from commsched.protocol import Decision, EndOfStep, Lost, Message, Plan, Ready

__all__ = ["DispatchPolicy", "FifoPolicy", "FollowerPolicy", "ImmediatePolicy", "LeaderPolicy", "PlannedPolicy",
           "PriorityPolicy", "Recorded", "StaticFollower", "StaticLeader", "Unstarted", "agrees_on_order",
           "edd_replay_order", "fits", "load_plan", "make_policy", "replay_policy"]


def fits(in_flight: int, nbytes: int, credit: int) -> bool:
    """The credit rule: within ``credit`` bytes, or alone on an idle link."""
    return in_flight + nbytes <= credit or in_flight == 0


def _task_of(piece_name: str) -> str:
    return piece_name.rsplit("#", 1)[0]


class Unstarted:
    """The pieces ready on this rank but not started, and the tasks whose data is not ready yet.

    Pieces need ``.task``, ``.name`` and ``.key``; tasks ``.step`` and ``.name``. With
    ``in_order`` (``fifo``), a task whose data arrives before an earlier reserved one
    is parked until that one's data is there too.
    """

    def __init__(self, in_order: bool = False) -> None:
        self._pieces: dict[tuple[int, str], Any] = {}
        self._waiting: dict[tuple[int, str], Any] = {}
        self._open: collections.Counter[int] = collections.Counter()  # per step: pieces + waiting tasks
        self._in_order = in_order
        self._reserved: collections.deque = collections.deque()  # in_order: reserved tasks not yet handed on
        self._parked: dict[int, tuple[Any, Any]] = {}  # id(task) -> (task, what arrived with it)

    def add(self, piece: Any) -> None:
        key = (piece.task.step, piece.name)
        if key in self._pieces:
            raise ValueError(f"tensor {piece.task.name!r} was submitted twice in step {key[0]} before its first "
                             "submission started; names must be unique per step")
        self._pieces[key] = piece
        self._open[key[0]] += 1

    def started(self, piece: Any) -> None:
        del self._pieces[(piece.task.step, piece.name)]
        self._close(piece.task.step)

    def wait_for(self, task: Any) -> None:
        """``task`` belongs to its step, but its data is not ready yet."""
        key = (task.step, task.name)
        if key in self._waiting:
            raise ValueError(f"tensor {task.name!r} was reserved twice in step {task.step}; names must be unique "
                             "per step")
        self._waiting[key] = task
        self._open[task.step] += 1
        if self._in_order:
            self._reserved.append(task)

    def arrived(self, task: Any, data: Any) -> list[tuple[Any, Any]]:
        """``task``'s data is ready: the ``(task, data)`` pairs to submit now, in order.

        Empty if ``task`` was not waiting (closed or failed meanwhile) or is parked
        behind an earlier reservation."""
        if self._waiting.get((task.step, task.name)) is not task:
            return []
        del self._waiting[(task.step, task.name)]
        self._close(task.step)
        if not self._in_order:
            return [(task, data)]
        self._parked[id(task)] = (task, data)
        out = []
        while self._reserved and id(self._reserved[0]) in self._parked:
            out.append(self._parked.pop(id(self._reserved.popleft())))
        return out

    def _close(self, step: int) -> None:
        self._open[step] -= 1
        if not self._open[step]:
            del self._open[step]

    def get(self, step: int, piece_name: str) -> Any:
        return self._pieces.get((step, piece_name))

    def is_waiting(self, step: int, task_name: str) -> bool:
        return (step, task_name) in self._waiting

    def waiting_in(self, step: int) -> bool:
        return any(s == step for s, _ in self._waiting)

    def holds(self, task: Any) -> bool:
        """``task`` is waiting for its data or parked here."""
        return self._waiting.get((task.step, task.name)) is task or id(task) in self._parked

    def open_in(self, step: int) -> int:
        """Pieces not started plus tasks without data, in ``step``."""
        return self._open.get(step, 0)

    def names_in(self, step: int) -> list[str]:
        return sorted(name for s, name in self._pieces if s == step)

    def pieces(self) -> list[Any]:
        return list(self._pieces.values())

    def describe(self) -> list[str]:
        """What is here, for error messages: queued pieces (most urgent first), then waiting tasks."""
        names = [f"{p.name} (queued)" for p in sorted(self._pieces.values(), key=lambda p: p.key)]
        names += [f"{t.name} (waiting for data)" for t in self._waiting.values()]
        names += [f"{t.name} (waiting for an earlier reservation)" for t, _ in self._parked.values()]
        return names

    def __len__(self) -> int:
        return len(self._pieces)


class DispatchPolicy:
    """Base: what every policy answers. The scheduler calls these with its lock held."""

    #: how this rank decides order (``Scheduler.mode``): local, leader, follower, fifo or immediate
    mode = "local"
    #: rank 0 of ``dynamic``/``static``: decisions are published to the followers
    publishes = False
    #: followers: decisions are read from rank 0
    reads_decisions = False
    #: rank 0 of ``dynamic`` with ``ready_reports``: the followers' ready reports are read (it decides on them)
    reads_reports = False
    #: followers of ``dynamic`` with ``ready_reports``: each gradient is reported to rank 0 as it is ready here
    reports_ready = False
    #: tensors reserved before their data is ready are submitted in reservation order (``fifo``:
    #: no agreement, so every rank must submit in its user thread's order)
    in_reservation_order = False

    def __init__(self, credit_bytes: int) -> None:
        self.credit_bytes = credit_bytes

    def admit(self, step: int, task_name: str, n_pieces: int) -> None:
        """A task is submitted in ``step``; raise if this policy cannot take it."""

    def bounds_for(self, task_name: str, numel: int, element_size: int) -> list[tuple[int, int]] | None:
        """The pieces of task ``task_name`` (element ranges), or None: cut at the config's
        ``partition_bytes``. Raise if this policy cannot take such a task. Pure; any thread."""
        return None

    def algorithm_of(self, piece_name: str) -> str:
        """How the backend should all-reduce that piece (:attr:`commsched.task.Piece.algorithm`)."""
        return "ring"

    def add(self, piece: Any) -> None:
        """``piece`` is ready on this rank (also recorded in :class:`Unstarted`)."""

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        """The piece to start now, or None. ``step`` is this rank's current step."""
        raise NotImplementedError

    def issued(self, piece: Any) -> list[Message]:
        """``piece`` started; the messages to publish about it."""
        return []

    def steps_over(self, unstarted: Unstarted, step: int) -> list[Message]:
        """Messages for steps that are over (leader), checked after each dispatch pass."""
        return []

    def step_ended(self, step: int, names: set[str]) -> None:
        """The user ended ``step`` having submitted ``names``; raise if the policy cannot accept that."""

    def receive(self, messages: list[Message]) -> None:
        """Decisions from rank 0 (followers); the followers' ready reports (rank 0 with ``reads_reports``)."""

    @property
    def done_reading(self) -> bool:
        """True once nothing more will be published (a follower's reader may stop)."""
        return False


class FifoPolicy(DispatchPolicy):
    """Local submission order within the credit; no agreement (a baseline; engines that negotiate)."""

    mode = "fifo"
    in_reservation_order = True

    def __init__(self, credit_bytes: int | None) -> None:
        super().__init__(credit_bytes or 0)
        self._limited = credit_bytes is not None
        self._queue: collections.deque = collections.deque()

    def add(self, piece: Any) -> None:
        self._queue.append(piece)

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        if self._queue and (not self._limited or fits(in_flight, self._queue[0].nbytes, self.credit_bytes)):
            return self._queue.popleft()
        return None


class ImmediatePolicy(FifoPolicy):
    """Submission order, no credit (Horovod ranks > 0)."""

    mode = "immediate"
    in_reservation_order = False  # Horovod matches by name: order does not matter

    def __init__(self) -> None:
        super().__init__(None)


class PriorityPolicy(DispatchPolicy):
    """The most urgent ready piece within the credit: smallest ``(step, priority, seq, index)``.

    The key is unique, so pieces are never compared; head-of-line: if the most urgent
    piece does not fit, nothing starts (it goes as soon as credit frees, ahead of
    everything queued: preemption at piece boundaries).
    """

    def __init__(self, credit_bytes: int) -> None:
        super().__init__(credit_bytes)
        self._heap: list[tuple[int, int, int, int, Any]] = []

    def add(self, piece: Any) -> None:
        heapq.heappush(self._heap, (*piece.key, piece))

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        if self._heap and fits(in_flight, self._heap[0][-1].nbytes, self.credit_bytes):
            return heapq.heappop(self._heap)[-1]
        return None

    def queued_keys(self) -> list[tuple]:
        """The keys of the pieces waiting in the queue (for observers)."""
        return [entry[-1].key for entry in self._heap]


class LeaderPolicy(PriorityPolicy):
    """Rank 0 of ``dynamic``: priority order, each decision published; ``E step`` once a step fully started.

    ``ahead`` (``SchedulerConfig.decide_ahead``): once a step's order is final, which is when the
    user ended the step and none of its gradients is still to come, the rest of that step's
    pieces are decided at once, in priority order, and published in one batch ahead of the
    credit that lets each start (``next()`` then hands them out in that order as credit frees).
    Nothing more urgent can arrive later: every later piece belongs to a later step. So the
    order is the one the per-piece rule gives, and the followers stop waiting for a message
    per piece: each starts the next piece when its own credit frees.

    ``followers`` (``SchedulerConfig.ready_reports``: the number of other ranks, which report each
    gradient as it is ready there): a piece joins the queue once its gradient is ready on every
    rank. A collective moves only when the last rank issues it, so a piece decided on rank 0's
    readiness alone, while a follower is still computing that gradient, holds its credit and the
    link idles, while pieces ready everywhere wait behind it (balanced, 2 workers, 1 Gbit/s: in the
    steps where rank 0's backward ran ahead, 19-25 MB of 69 crossed during backward, against 47-57 MB
    where it ran behind; docs/tuning.md). When nothing is in flight and nothing is ready everywhere,
    the most urgent piece ready here starts anyway (the link is idle; it never waits on a report that
    may not come). Without reports (lost store) it decides on its own readiness, as with 0.
    """

    mode = "leader"
    publishes = True

    def __init__(self, credit_bytes: int, ahead: bool = False, followers: int = 0) -> None:
        super().__init__(credit_bytes)
        self.ahead = bool(ahead)
        self._ended = 0  # steps < this have had their END published
        self._decided: collections.deque = collections.deque()  # published ahead, not started yet
        self._published: set[int] = set()  # id() of the pieces in ``_decided``
        self.ahead_total = 0  # pieces published ahead so far (``Scheduler.stats()["decided_ahead"]``)
        self.followers = int(followers)
        self.reads_reports = self.followers > 0
        self._reports: collections.Counter[tuple[int, str]] = collections.Counter()  # (step, task) -> followers ready
        self._held: dict[tuple[int, str], list[Any]] = {}  # ready here, not yet on every follower (never empty lists)
        self.reports_lost: BaseException | None = None
        self.held_total = 0  # pieces that waited for a follower's report (``Scheduler.stats()``)
        self.forced_total = 0  # of those, started before every report came (the link was idle)

    def add(self, piece: Any) -> None:
        key = (piece.task.step, piece.task.name)
        if self.reads_reports and self._reports[key] < self.followers:
            self._held.setdefault(key, []).append(piece)
            self.held_total += 1
            return
        super().add(piece)

    def receive(self, messages: list[Message]) -> None:
        for message in messages:
            if isinstance(message, Lost):  # no more reports can come: decide on this rank's readiness
                self.reports_lost, self.reads_reports = message.error, False
                for key in list(self._held):
                    self._release(key)
            elif isinstance(message, Ready) and self.reads_reports:
                key = (message.step, message.task)
                self._reports[key] += 1
                if self._reports[key] >= self.followers:
                    self._release(key)

    def _release(self, key: tuple[int, str]) -> None:
        for piece in self._held.pop(key, ()):
            super().add(piece)

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        if self._decided:  # more urgent than anything in the heap (an earlier step), in order
            if fits(in_flight, self._decided[0].nbytes, self.credit_bytes):
                return self._decided.popleft()
            return None
        piece = super().next(unstarted, step, in_flight)
        if piece is None and in_flight == 0 and self._held:  # an idle link: the most urgent piece ready here
            key = min(self._held, key=lambda k: self._held[k][0].key)
            pieces = self._held[key]
            piece = pieces.pop(0)
            if not pieces:
                del self._held[key]
            self.forced_total += 1
        return piece

    def step_ended(self, step: int, names: set[str]) -> None:
        super().step_ended(step, names)
        if self._reports:  # reports of steps two back can no longer matter (every rank ended them)
            for key in [k for k in self._reports if k[0] < step - 1]:
                del self._reports[key]

    def issued(self, piece: Any) -> list[Message]:
        if id(piece) in self._published:
            self._published.discard(id(piece))
            return []
        return [Decision(piece.task.step, piece.name)]

    def queued_keys(self) -> list[tuple]:
        """The keys of the pieces the rule chooses from (ready here and, with reports, on every rank)."""
        return [p.key for p in self._decided] + super().queued_keys()

    def held_keys(self) -> list[tuple]:
        """The keys of the pieces ready here that wait for a follower's report."""
        return sorted(p.key for pieces in self._held.values() for p in pieces)

    def _decide_ahead(self, unstarted: Unstarted, step: int) -> list[Message]:
        """Every queued piece of the ended steps whose gradients are all here (and, with reports, on
        every follower), in priority order."""
        out: list[Message] = []
        while (self._heap and self._heap[0][0] < step and not unstarted.waiting_in(self._heap[0][0])
               and not any(held_step == self._heap[0][0] for held_step, _ in self._held)):
            piece = heapq.heappop(self._heap)[-1]
            self._decided.append(piece)
            self._published.add(id(piece))
            out.append(Decision(piece.task.step, piece.name))
        self.ahead_total += len(out)
        return out

    def steps_over(self, unstarted: Unstarted, step: int) -> list[Message]:
        out: list[Message] = self._decide_ahead(unstarted, step) if self.ahead else []
        while self._ended < step and unstarted.open_in(self._ended) == 0:
            out += self._step_over(self._ended)
            self._ended += 1
        return out

    def _step_over(self, step: int) -> list[Message]:
        return [EndOfStep(step)]


class FollowerPolicy(DispatchPolicy):
    """Ranks > 0 of ``dynamic``: issue exactly rank 0's sequence, each piece once ready here and within credit.

    Disagreement is detected, never hung on: a decision for a piece this rank does not
    have in an ended step, or an END of a step for which this rank has pieces rank 0
    never sent, raises :class:`OrderAgreementError` naming them.
    """

    mode = "follower"
    reads_decisions = True

    def __init__(self, credit_bytes: int, rank: int, reports: bool = False) -> None:
        super().__init__(credit_bytes)
        self.rank = rank
        self.reports_ready = bool(reports)  # each gradient reported to rank 0 as it is ready here (``Ready``)
        self._agreed: collections.deque[Message] = collections.deque()
        self.lost: BaseException | None = None  # the store failed: rank 0's decisions cannot arrive

    def receive(self, messages: list[Message]) -> None:
        for message in messages:
            if isinstance(message, Lost):
                self.lost = message.error
            else:
                self._agreed.append(message)

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        if not self._agreed and len(unstarted) and self.lost is not None:
            error = CommschedError(f"rank {self.rank} lost contact with rank 0's decisions (the store failed: "
                                   f"{self.lost!r}) while {len(unstarted)} piece(s) wait to be sent")
            error.__cause__ = self.lost
            raise error
        while self._agreed:
            message = self._agreed[0]
            if isinstance(message, Decision):
                piece = unstarted.get(message.step, message.piece)
                if piece is None:
                    if not unstarted.is_waiting(message.step, _task_of(message.piece)) and step > message.step:
                        raise OrderAgreementError(
                            f"rank 0 communicated {message.piece!r} in step {message.step} but rank {self.rank} has "
                            "no such gradient in that step: every rank must produce the same gradients (an unused "
                            "parameter must be unused on every rank)")
                    return None
                if not fits(in_flight, piece.nbytes, self.credit_bytes):
                    return None
                self._agreed.popleft()
                return piece
            ended = message.step if isinstance(message, EndOfStep) else 0
            if step <= ended or unstarted.waiting_in(ended):
                return None  # wait until this rank has ended that step too, with all its data
            extra = unstarted.names_in(ended)
            if extra:
                raise OrderAgreementError(
                    f"rank {self.rank} has gradients for {extra[:10]} in step {ended} but rank 0 did not "
                    "communicate them: every rank must produce the same gradients (an unused parameter must "
                    "be unused on every rank)")
            self._agreed.popleft()
            if isinstance(message, Plan):
                self._plan_arrived(message, unstarted)
                return self.next(unstarted, step, in_flight)
        return None

    def _plan_arrived(self, message: Plan, unstarted: Unstarted) -> None:
        raise CommschedError("rank 0 published a static plan, but this rank does not run ordering='static'")


class _StaticPlan:
    """The recorded step's order, walked again every later step; the one place its checks live."""

    def __init__(self, pieces: tuple[str, ...], first_step: int = 1) -> None:
        self.pieces = pieces
        self._names = set(pieces)
        self._tasks = {_task_of(p) for p in pieces}
        self._pos = 0
        self._step = first_step

    def check_task(self, task_name: str, n_pieces: int) -> None:
        if any(f"{task_name}#{i}" not in self._names for i in range(n_pieces)):
            raise OrderAgreementError(
                f"tensor {task_name!r} ({n_pieces} pieces) does not match the static plan made in the profiling "
                "step (it is new there, or its size changed); ordering='static' needs the same tensors, of the "
                "same sizes, every step (use ordering='dynamic')")

    def check_step(self, step: int, names: set[str]) -> None:
        missing = sorted(self._tasks - names)
        if missing:
            raise OrderAgreementError(
                f"step {step} communicated no gradient for {missing[:10]} although the static plan expects it "
                "every step (an unused parameter?); use ordering='dynamic' for models whose set of gradients "
                "changes between steps")

    def next(self, unstarted: Unstarted, step: int, in_flight: int, credit: int) -> Any:
        if not self.pieces:  # the profiling step communicated nothing (only zero-size tensors)
            return None
        name = self.pieces[self._pos]
        piece = unstarted.get(self._step, name)
        if piece is None:
            if step > self._step and not unstarted.is_waiting(self._step, _task_of(name)):
                self.check_step(self._step, set())  # raises: the step ended without this tensor
            return None
        if not fits(in_flight, piece.nbytes, credit):
            return None
        self._pos += 1
        if self._pos == len(self.pieces):
            self._pos = 0
            self._step += 1
        return piece


class Recorded(NamedTuple):
    """A piece rank 0 issued in the recorded step of a static replay: its name, priority key,
    when its task was submitted (µs, the scheduler's clock), its bytes and its algorithm."""

    name: str
    key: tuple
    ready_us: float
    nbytes: int
    algorithm: str


def edd_replay_order(recorded: Sequence[Recorded], credit_bytes: int,
                     seconds: Callable[[int, str], float]) -> list[str]:
    """The order :class:`PriorityPolicy` would issue ``recorded`` in on a link where one piece
    takes ``seconds(nbytes, algorithm)``, the pieces become ready when they did in the recorded
    step, and the link serves the issued pieces one after another within ``credit_bytes``.

    Why: a replay of the order rank 0 *issued* carries that step's link speed. A step whose
    communication was slow (the peer late, the CPUs contended) queues the early layers' gradients behind each
    other, and a later, faster step then waits, link idle, for a gradient the recorded order
    put first but the backward has not made yet. With ``seconds`` from the topology the plan
    was made for (the link as probed, not contended), the order keeps the link busy whenever
    anything recorded as ready is waiting, and still puts urgent layers first where the
    readiness allows (docs/planner.md, "The replayed order").
    """
    pending = sorted(recorded, key=lambda r: (r.ready_us, r.key))
    if not pending:
        return []
    t0 = pending[0].ready_us
    ready_s = [(r.ready_us - t0) / 1e6 for r in pending]
    queue: list[tuple[tuple, int]] = []
    flight: list[tuple[float, int]] = []  # (completion s, bytes)
    in_flight = 0
    link_free = clock = 0.0
    order: list[str] = []
    i = 0
    while len(order) < len(pending):
        while i < len(pending) and ready_s[i] <= clock:
            heapq.heappush(queue, (pending[i].key, i))
            i += 1
        while flight and flight[0][0] <= clock:
            in_flight -= heapq.heappop(flight)[1]
        if queue and (not flight or fits(in_flight, pending[queue[0][1]].nbytes, credit_bytes)):
            piece = pending[heapq.heappop(queue)[1]]
            link_free = max(clock, link_free) + max(0.0, float(seconds(piece.nbytes, piece.algorithm)))
            heapq.heappush(flight, (link_free, piece.nbytes))
            in_flight += piece.nbytes
            order.append(piece.name)
            continue
        events = ([ready_s[i]] if i < len(pending) else []) + ([flight[0][0]] if flight else [])
        clock = max(clock, min(events))
    return order


class _StaticMixin:
    """Shared by both static roles: the plan's checks and walk after the recorded step.

    ``record_step`` (``R``): steps ``0..R`` run as ``dynamic`` (rank 0 decides by priority and
    publishes each decision); the order rank 0 issued in step ``R`` (or its leader's
    ``reorder`` of that step) becomes the plan, walked every step from ``R + 1`` on with no
    message. ``static`` records step 0 as issued; a plan whose order is ``"observed"`` records
    :data:`commsched.plan.OBSERVED_STEP` (a warm step: step 0 is a warm-up) and reorders it on
    the plan's link (:func:`edd_replay_order`, docs/planner.md).
    """

    plan: _StaticPlan | None = None
    credit_bytes: int
    record_step: int = 0

    def _set_record_step(self, record_step: int) -> None:
        if int(record_step) < 0:
            raise ValueError(f"record_step={record_step!r}: the step whose order is replayed must be >= 0")
        self.record_step = int(record_step)

    def admit(self, step: int, task_name: str, n_pieces: int) -> None:
        if step > self.record_step and self.plan is not None:
            self.plan.check_task(task_name, n_pieces)

    def step_ended(self, step: int, names: set[str]) -> None:
        if step > self.record_step and self.plan is not None:
            self.plan.check_step(step, names)

    def _walk(self, unstarted: Unstarted, step: int, in_flight: int) -> tuple[bool, Any]:
        """(True, piece or None) once the plan is in force: the recorded step fully started, this rank past it."""
        if self.plan is None or step <= self.record_step or unstarted.open_in(self.record_step):
            return False, None
        return True, self.plan.next(unstarted, step, in_flight, self.credit_bytes)


class StaticLeader(_StaticMixin, LeaderPolicy):
    """Rank 0 of ``static``: steps up to the recorded one (step 0 by default) as
    :class:`LeaderPolicy`; the recorded step's order becomes the plan (``L``)."""

    def __init__(self, credit_bytes: int, record_step: int = 0,
                 reorder: Callable[[list[Recorded]], Sequence[str]] | None = None, ahead: bool = False) -> None:
        super().__init__(credit_bytes, ahead=ahead)
        self._set_record_step(record_step)
        self._recorded: list[Recorded] = []
        self.reorder = reorder

    def add(self, piece: Any) -> None:
        if piece.task.step <= self.record_step:
            super().add(piece)  # later steps are walked from the plan

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        planned, piece = self._walk(unstarted, step, in_flight)
        return piece if planned else super().next(unstarted, step, in_flight)

    def issued(self, piece: Any) -> list[Message]:
        if piece.task.step > self.record_step:
            return []  # the plan fixes every later step: no per-step messages
        if piece.task.step == self.record_step:
            self._recorded.append(Recorded(piece.name, tuple(piece.key), float(piece.task.submitted_us),
                                           int(piece.nbytes), getattr(piece, "algorithm", "ring")))
        return super().issued(piece)

    def _step_over(self, step: int) -> list[Message]:
        if self.plan is not None:
            return []
        if step < self.record_step:
            return [EndOfStep(step)]
        issued = [r.name for r in self._recorded]
        order = tuple(self.reorder(list(self._recorded))) if self.reorder is not None else tuple(issued)
        if sorted(order) != sorted(issued):
            raise CommschedError(f"the replay order of the recorded step is not a permutation of its {len(issued)} "
                                 "pieces (a bug in the reorder function)")
        self.plan = _StaticPlan(order, first_step=self.record_step + 1)
        return [EndOfStep(step), Plan(self.plan.pieces)]


class StaticFollower(_StaticMixin, FollowerPolicy):
    """Ranks > 0 of ``static``: steps up to the recorded one as :class:`FollowerPolicy`, then
    the plan rank 0 published."""

    def __init__(self, credit_bytes: int, rank: int, record_step: int = 0) -> None:
        super().__init__(credit_bytes, rank)
        self._set_record_step(record_step)

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        planned, piece = self._walk(unstarted, step, in_flight)
        return piece if planned else super().next(unstarted, step, in_flight)

    def _plan_arrived(self, message: Plan, unstarted: Unstarted) -> None:
        self.plan = _StaticPlan(message.pieces, first_step=self.record_step + 1)
        for piece in unstarted.pieces():  # pieces of later steps queued before the plan was known
            if piece.task.step > self.record_step and piece.name not in message.pieces:
                raise OrderAgreementError(
                    f"tensor {piece.task.name!r} was not communicated in the profiling step, so the static plan "
                    "has no place for it; use ordering='dynamic'")

    @property
    def done_reading(self) -> bool:
        return self.plan is not None


class PlannedPolicy(DispatchPolicy):
    """``ordering="planned"``: the plan's piece order, within the plan's credit, on every rank from step 0.

    Every rank walks :attr:`commsched.plan.Plan.pieces` in order, step after step: the
    next piece goes once it is ready here and fits the credit (or goes alone), so every
    rank issues the same sequence with no message at all (the plan's digest was compared
    with rank 0's before the first step). Each task is cut at its plan group's piece size
    (:meth:`bounds_for`) and each piece carries the plan's algorithm (:meth:`algorithm_of`).

    Pure, like the other policies: :meth:`add` keeps the ready pieces itself, so a
    simulator can drive it with ``add``/``next`` alone (an empty :class:`Unstarted` is
    enough; the runtime's is consulted only for tasks reserved without data yet).

    Refused, as :class:`~commsched.errors.OrderAgreementError` naming the tensor: a task
    that is not a group of the plan, or of another size; a step that ends without a
    planned task.

    Args:
        plan: the :class:`commsched.plan.Plan` to execute.
        credit_bytes: the most bytes in flight; default the plan's ``credit_bytes``.
    """

    mode = "planned"

    def __init__(self, plan: CommPlan, credit_bytes: int | None = None) -> None:
        if not isinstance(plan, CommPlan):
            raise TypeError(f"PlannedPolicy needs a commsched.plan.Plan, got {type(plan).__name__}; load one with "
                            "commsched.plan.Plan.from_json(path)")
        super().__init__(plan.credit_bytes if credit_bytes is None else int(credit_bytes))
        self.plan = plan
        self.pieces: tuple[str, ...] = plan.piece_names
        self._tasks = {p.task for p in plan.pieces}
        self._bounds: dict[str, tuple[tuple[int, int], list[tuple[int, int]]]] = {}
        self._ready: dict[tuple[int, str], Any] = {}
        self._pos = 0
        self._step = 0

    # -------------------------------------------------------------- checks
    def bounds_for(self, task_name: str, numel: int, element_size: int) -> list[tuple[int, int]]:
        size = (int(numel), int(element_size))
        cached = self._bounds.get(task_name)
        if cached is not None and cached[0] == size:
            return cached[1]
        group = self._group(task_name)
        want = (self.plan.group_numel(group), self.plan.group_element_size(group))
        if size != want:
            raise OrderAgreementError(
                f"tensor {task_name!r} has {size[0]} elements of {size[1]} B but the plan has {want[0]} of "
                f"{want[1]} B; make a plan for this model (`commsched plan`)")
        bounds = piece_bounds(want[0], want[1], group.partition_bytes)
        self._bounds[task_name] = (size, bounds)
        return bounds

    def _group(self, task_name: str) -> Any:
        try:
            return self.plan.group(task_name)
        except KeyError:
            names = [g.name for g in self.plan.groups]
            raise OrderAgreementError(
                f"tensor {task_name!r} is not in the plan (its groups: {names[:6]}{' ...' if len(names) > 6 else ''}"
                "); ordering='planned' reduces exactly the plan's gradients: make a plan for this model "
                "(`commsched plan`)") from None

    def admit(self, step: int, task_name: str, n_pieces: int) -> None:
        group = self._group(task_name)
        planned = len(self.plan.bounds(group))
        if n_pieces != planned:
            raise OrderAgreementError(
                f"tensor {task_name!r} was cut into {n_pieces} pieces but the plan has {planned}; submit planned "
                "tensors whole (the plan cuts them)")

    def step_ended(self, step: int, names: set[str]) -> None:
        missing = sorted(self._tasks - names)
        if missing:
            raise self._missing(step, missing)

    @staticmethod
    def _missing(step: int, missing: list[str]) -> OrderAgreementError:
        return OrderAgreementError(
            f"step {step} communicated no gradient for {missing[:10]} although the plan expects one every "
            "step (an unused parameter?); every planned gradient must be produced every step, on every rank "
            "(use ordering='dynamic' for models whose set of gradients changes)")

    def algorithm_of(self, piece_name: str) -> str:
        return self.plan.algorithm_of(piece_name)

    # ---------------------------------------------------------------- walk
    def add(self, piece: Any) -> None:
        self._ready[(piece.task.step, piece.name)] = piece

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        if not self.pieces:
            return None
        name = self.pieces[self._pos]
        piece = self._ready.get((self._step, name))
        if piece is None:
            if step > self._step and not unstarted.is_waiting(self._step, _task_of(name)):
                raise self._missing(self._step, [_task_of(name)])  # that step ended without this tensor
            return None
        if not fits(in_flight, piece.nbytes, self.credit_bytes):
            return None
        del self._ready[(self._step, name)]
        self._pos += 1
        if self._pos == len(self.pieces):
            self._pos = 0
            self._step += 1
        return piece

    def queued_keys(self) -> list[tuple]:
        """The keys of the ready pieces not started yet (for observers)."""
        return [p.key for p in self._ready.values()]

    @property
    def position(self) -> tuple[int, int]:
        """``(step, index into plan.pieces)`` of the next piece to issue."""
        return self._step, self._pos


class PlannedImmediate(ImmediatePolicy):
    """``ordering="planned"`` on the ranks > 0 of an engine that negotiates order (Horovod): each
    task cut at its plan group's piece size, checked against the plan and given the plan's
    algorithm per piece exactly as :class:`PlannedPolicy` does, then started as soon as it is
    ready (Horovod's coordinator matches pieces by name; rank 0 paces them in the plan's order
    within its credit). Without the plan's cut here, ranks > 0 would cut at ``partition_bytes``
    and offer Horovod pieces of other sizes under the same names."""

    mode = "immediate"

    def __init__(self, plan: CommPlan) -> None:
        super().__init__()
        self._plan = PlannedPolicy(plan)

    def bounds_for(self, task_name: str, numel: int, element_size: int) -> list[tuple[int, int]]:
        return self._plan.bounds_for(task_name, numel, element_size)

    def admit(self, step: int, task_name: str, n_pieces: int) -> None:
        self._plan.admit(step, task_name, n_pieces)

    def step_ended(self, step: int, names: set[str]) -> None:
        self._plan.step_ended(step, names)

    def algorithm_of(self, piece_name: str) -> str:
        return self._plan.algorithm_of(piece_name)


class PlanCutPriority(DispatchPolicy):
    """``ordering="planned"`` with a plan whose ``order`` is ``"priority"``: the plan's pieces
    (groups, fusion, piece sizes, algorithm per piece, credit), issued in the runtime's order.

    The cut, the checks and the algorithms are :class:`PlannedPolicy`'s (a task outside the
    plan, of another size, or missing from a step is refused the same way); which piece goes
    next is ``inner``'s: on engines that do not negotiate order, rank 0 decides by priority and
    publishes (:class:`LeaderPolicy`) and the others follow (:class:`FollowerPolicy`), as in
    ``dynamic``; with ``order`` ``"observed"``, steps up to :data:`~commsched.plan.OBSERVED_STEP`
    so and every later step in that step's order with no message (:class:`StaticLeader`/
    :class:`StaticFollower`, as ``static``, which records step 0); with one
    rank, or in a replay, :class:`PriorityPolicy`. So a plan that only fixes settings runs
    exactly as ``dynamic`` (or ``static``) does with those settings, and a gradient ready later
    than the profile said holds back nothing behind it (docs/planner.md, "What the order
    costs").
    """

    def __init__(self, plan: CommPlan, inner: DispatchPolicy) -> None:
        super().__init__(inner.credit_bytes)
        self.plan = plan
        self.inner = inner
        self._cut = PlannedPolicy(plan)
        self.mode = inner.mode
        self.publishes = inner.publishes
        self.reads_decisions = inner.reads_decisions
        self.in_reservation_order = inner.in_reservation_order
        self.reports_ready = inner.reports_ready

    @property
    def reads_reports(self) -> bool:  # type: ignore[override]  # the leader stops reading once reports are lost
        return self.inner.reads_reports

    def bounds_for(self, task_name: str, numel: int, element_size: int) -> list[tuple[int, int]]:
        return self._cut.bounds_for(task_name, numel, element_size)

    def admit(self, step: int, task_name: str, n_pieces: int) -> None:
        self._cut.admit(step, task_name, n_pieces)
        self.inner.admit(step, task_name, n_pieces)

    def step_ended(self, step: int, names: set[str]) -> None:
        self._cut.step_ended(step, names)
        self.inner.step_ended(step, names)

    def algorithm_of(self, piece_name: str) -> str:
        return self._cut.algorithm_of(piece_name)

    def add(self, piece: Any) -> None:
        self.inner.add(piece)

    def next(self, unstarted: Unstarted, step: int, in_flight: int) -> Any:
        return self.inner.next(unstarted, step, in_flight)

    def issued(self, piece: Any) -> list[Message]:
        return self.inner.issued(piece)

    def steps_over(self, unstarted: Unstarted, step: int) -> list[Message]:
        return self.inner.steps_over(unstarted, step)

    def receive(self, messages: list[Message]) -> None:
        self.inner.receive(messages)

    @property
    def done_reading(self) -> bool:
        return self.inner.done_reading

    def queued_keys(self) -> list[tuple]:
        return getattr(self.inner, "queued_keys", list)()


def agrees_on_order(config: SchedulerConfig, world_size: int, negotiates_order: bool) -> bool:
    """Whether this ordering needs rank 0's decisions carried to the others through a store."""
    return world_size > 1 and not negotiates_order and config.ordering in ("dynamic", "static")


def replay_policy(ordering: str, credit_bytes: int, plan: CommPlan | None = None) -> DispatchPolicy:
    """The rule of the deciding rank alone, for an offline replay or a simulator: ready order
    for ``fifo``, priority order for ``dynamic``/``static`` (``static`` replays like ``dynamic``),
    ``plan``'s order for ``planned`` (:class:`PlannedPolicy`; ``credit_bytes`` None: the plan's;
    a plan whose ``order`` is ``"priority"`` or ``"observed"``: its pieces in priority order,
    :class:`PlanCutPriority`)."""
    if ordering == "planned":
        if plan is None:
            raise ValueError("replay_policy('planned', ...) needs plan=<a commsched.plan.Plan>")
        if plan.order in ("priority", "observed"):  # one deciding rank: step 0's order is its priority order
            return PlanCutPriority(plan, PriorityPolicy(plan.credit_bytes if credit_bytes is None else credit_bytes))
        return PlannedPolicy(plan, credit_bytes)
    return FifoPolicy(credit_bytes) if ordering == "fifo" else PriorityPolicy(credit_bytes)


def load_plan(config: SchedulerConfig) -> CommPlan:
    """``config.plan`` as a :class:`commsched.plan.Plan` (read from its JSON if a path)."""
    plan = config.plan
    if plan is None:
        raise ValueError("ordering='planned' needs a plan here: pass SchedulerConfig(ordering='planned', "
                         "plan='plan.json') (make one with `commsched plan`); planning in-process from the first "
                         "steps is done by the plugins' optimizers, not by a bare Scheduler")
    return plan if isinstance(plan, CommPlan) else CommPlan.from_json(plan)


def _plan_reorder(plan: CommPlan) -> Callable[[list[Recorded]], list[str]] | None:
    """For an ``observed`` plan: :func:`edd_replay_order` on the link of the plan's topology
    (None when the plan carries no topology: the recorded order is replayed as issued)."""
    if not plan.topology:
        return None
    from commsched.costmodel.collectives import allreduce_s
    from commsched.costmodel.topology import Topology

    topology = Topology.from_dict(plan.topology)
    credit = plan.credit_bytes

    def reorder(recorded: list[Recorded]) -> list[str]:
        return edd_replay_order(recorded, credit, lambda nbytes, algorithm: allreduce_s(topology, nbytes, algorithm))
    return reorder


def make_policy(config: SchedulerConfig, rank: int, world_size: int, negotiates_order: bool) -> DispatchPolicy:
    """The policy of this rank: the one place where ``ordering`` is looked at."""
    credit = config.credit_bytes
    if config.ordering == "auto":
        raise ValueError("ordering='auto' is a tuner over the other orderings, driven by the PyTorch "
                         "DistributedOptimizer at step boundaries; a Scheduler (or another plugin) needs one of "
                         "dynamic, static, fifo, planned")
    if config.ordering not in ("dynamic", "static", "fifo", "planned"):
        raise ValueError(f"ordering={config.ordering!r} has no dispatch policy")
    if config.ordering == "planned":  # the plan's order on every rank (one rank: the same), no agreement needed
        plan = load_plan(config)
        if negotiates_order and world_size > 1 and rank != 0:
            return PlannedImmediate(plan)
        if plan.order in ("priority", "observed"):  # the plan's pieces in dynamic's (or static's) order
            credit = plan.credit_bytes
            if world_size <= 1 or negotiates_order:  # one rank, or Horovod's coordinator matching by name
                return PlanCutPriority(plan, PriorityPolicy(credit))
            # observed: step 0 as dynamic, then step 0's order with no message per step (static's roles)
            if plan.order == "observed":
                inner: DispatchPolicy = (StaticLeader(credit, record_step=OBSERVED_STEP, reorder=_plan_reorder(plan),
                                                      ahead=config.decide_ahead)
                                         if rank == 0 else StaticFollower(credit, rank, record_step=OBSERVED_STEP))
            else:
                reports = bool(config.ready_reports)
                inner = (LeaderPolicy(credit, ahead=config.decide_ahead, followers=world_size - 1 if reports else 0)
                         if rank == 0 else FollowerPolicy(credit, rank, reports=reports))
            return PlanCutPriority(plan, inner)
        return PlannedPolicy(plan)
    if world_size <= 1:
        return PriorityPolicy(credit)
    if negotiates_order and config.ordering != "fifo":
        return PriorityPolicy(credit) if rank == 0 else ImmediatePolicy()
    if not agrees_on_order(config, world_size, negotiates_order):
        return FifoPolicy(credit)
    if config.ordering == "static":
        return StaticLeader(credit, ahead=config.decide_ahead) if rank == 0 else StaticFollower(credit, rank)
    reports = bool(config.ready_reports)
    return (LeaderPolicy(credit, ahead=config.decide_ahead, followers=world_size - 1 if reports else 0) if rank == 0
            else FollowerPolicy(credit, rank, reports=reports))
