"""Offline replay of the scheduler's dispatch policy on a modelled clock: a fixed issue order.

The live :class:`~commsched.scheduler.Scheduler` decides which piece goes next at
run time. Some engines cannot ask anything at run time: a TensorFlow step is a
graph, and the order of its collectives must be written into the graph before
it runs, identically on every worker. For them this module *replays* the same
dispatch policy objects the scheduler runs (:func:`commsched.policy.replay_policy`)
on a model of the backward pass and returns the order they produce.

The replay uses the scheduler's own definitions:

* **partition**: tensors are cut with :func:`commsched.partition.piece_bounds`;
  pieces are named ``"<tensor>#<index>"`` as in the scheduler;
* **priority**: smaller is more urgent (0 = what the next forward needs first);
  among ready pieces the smallest ``(priority, seq, index)`` starts first, where
  ``seq`` is the order in which tensors became ready (their submission order),
  so ties are stable. With ``ordering="fifo"`` the key is ``(seq, index)``;
* **credit**: bytes in flight ≤ ``credit_bytes``, except that one piece larger
  than the credit may go alone when nothing else is in flight; the queue is
  head-of-line (if the most urgent ready piece does not fit, nothing starts);
* **slots** (optional): at most ``slots`` pieces in flight. An engine that paces
  by a fixed number of ordering chains (TensorFlow's ordering tokens) passes its
  number of chains; each planned piece records the slot (chain) it runs on.

The readiness model (:func:`backward_ready_times`): backward produces gradients
in reverse forward order, each after a time proportional to its size; the link
(:class:`CostModel`) carries one piece after another (a serial, pipelined link).
Only the *order* of the result is used by engines; the modelled times are for
the timeline and for tests. Pure priority order without readiness would send
nothing until backward ends (layer 0's gradient is ready last): the replay
interleaves readiness with priority because only *ready* pieces compete.

Guarantees of :func:`plan` (tested in ``tests/core/test_planner.py``):

1. every piece of every tensor appears exactly once, with the bounds of
   ``piece_bounds``;
2. at every issue, bytes in flight ≤ credit (or one piece alone) and pieces in
   flight ≤ slots; a slot's next piece starts only after its previous one ended;
3. a piece starts no earlier than it is ready, and when it starts no ready,
   unstarted piece has a smaller key;
4. the queue is work-conserving: it never idles while the most urgent ready
   piece fits;
5. the result is a pure function of the arguments (identical on every worker).

With ``ordering="planned"`` and ``plan=`` a :class:`commsched.plan.Plan`, the replay
drives :class:`~commsched.policy.PlannedPolicy`: each tensor is a plan *group* (named
as the group), cut at that group's piece size (``PlannedPolicy.bounds_for``), and the
issue order is the plan's piece order (guarantee 3 then reads: a piece starts no
earlier than it is ready and no earlier than the plan's previous piece); each piece
records the plan's ``algorithm``; ``partition_bytes`` is then only recorded.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from commsched.config import ORDERINGS
from commsched.partition import piece_bounds
from commsched.policy import PriorityPolicy, Unstarted, replay_policy
from commsched.task import Piece, Task

if TYPE_CHECKING:
    from commsched.plan import Plan as CommPlan

__all__ = ["CostModel", "Plan", "PlannedPiece", "PlanTensor", "backward_ready_times", "graph_lookahead_s", "plan"]


@dataclass(frozen=True)
class PlanTensor:
    """A tensor to reduce: its size, its priority and when backward produces it.

    ``priority``: smaller is more urgent (forward-use order). ``ready``: modelled
    time (seconds) at which its gradient exists.
    """

    name: str
    numel: int
    element_size: int
    priority: int
    ready: float = 0.0


@dataclass(frozen=True)
class CostModel:
    """The link and the backward pass, as simple rates.

    A piece of ``n`` bytes occupies the link for ``n / link_bytes_per_s`` seconds
    and arrives ``latency_s`` later; pieces use the link one after another.
    Backward produces ``backward_bytes_per_s`` bytes of gradient per second.
    """

    link_bytes_per_s: float = 1.25e8  # 1 Gbit/s
    latency_s: float = 2e-4  # software cost of one collective, measured 150-350 us
    backward_bytes_per_s: float = 1.25e8

    def __post_init__(self) -> None:
        if not (self.link_bytes_per_s > 0 and self.backward_bytes_per_s > 0 and self.latency_s >= 0):
            raise ValueError(f"CostModel needs positive rates and a latency >= 0, got {self!r}")


@dataclass(frozen=True)
class PlannedPiece:
    """One piece in the plan: which tensor, which elements, when and on which slot."""

    tensor: int  # index into the tensors given to plan()
    index: int  # piece index within the tensor
    name: str  # "<tensor name>#<index>", as the scheduler names pieces
    start: int
    stop: int
    nbytes: int
    priority: int
    seq: int
    slot: int  # the chain it runs on, 0..slots-1; -1 when plan() had no slot limit
    ready: float
    issue: float
    finish: float
    algorithm: str = "ring"  # the plan's, under ordering="planned"

    @property
    def key(self) -> tuple[int, int, int]:
        """The queue key under priority ordering: ``(priority, seq, index)``."""
        return (self.priority, self.seq, self.index)


@dataclass(frozen=True)
class Plan:
    """The replayed schedule: ``pieces`` in issue order (the order every worker uses)."""

    pieces: tuple[PlannedPiece, ...]
    credit_bytes: int
    partition_bytes: int
    slots: int | None
    ordering: str

    @property
    def order(self) -> list[str]:
        """Piece names in issue order."""
        return [p.name for p in self.pieces]

    @property
    def makespan(self) -> float:
        """Modelled time at which the last piece arrives."""
        return max((p.finish for p in self.pieces), default=0.0)

    def by_tensor(self, count: int | None = None) -> list[list[PlannedPiece]]:
        """For each tensor (in the order given to :func:`plan`), its pieces by index.

        ``count``: the number of tensors given to :func:`plan` (zero-size tensors have
        no pieces, so the plan alone cannot tell how many trailing ones there were).
        """
        if count is None:
            count = 1 + max((p.tensor for p in self.pieces), default=-1)
        out: list[list[PlannedPiece]] = [[] for _ in range(count)]
        for p in self.pieces:
            out[p.tensor].append(p)
        for pieces in out:
            pieces.sort(key=lambda p: p.index)
        return out


def backward_ready_times(nbytes: Sequence[int], cost: CostModel | None = None) -> list[float]:
    """Modelled ready time of each gradient, for tensors listed in forward order.

    Backward walks the list from the end: the last tensor's gradient is ready
    first, after ``nbytes[-1] / backward_bytes_per_s``; tensor ``i`` is ready
    once every tensor ``j >= i`` has been produced.
    """
    cost = cost or CostModel()
    times = [0.0] * len(nbytes)
    total = 0.0
    for i in range(len(nbytes) - 1, -1, -1):
        total += nbytes[i] / cost.backward_bytes_per_s
        times[i] = total
    return times


def graph_lookahead_s(credit_bytes: int, cost: CostModel | None = None) -> float:
    """The ``lookahead_s`` of :func:`plan` for a plan written into a graph (TensorFlow): how long
    a chain stays held once a piece takes it, ``credit_bytes`` at the link's rate (the pieces in
    flight share the link and finish about together).

    Measured on the TF benchmark (2 workers, 1 Gbit/s, 4 MiB pieces, 16 MiB credit): without it,
    the first layer's 1 MiB gradient (the next forward's first need) was planned behind the 4 MiB
    kernel of the last hidden layer on its chain and waited 134 ms for that kernel's completion
    (docs/tensorflow.md, step 2)."""
    cost = cost or CostModel()
    return credit_bytes / cost.link_bytes_per_s


def plan(tensors: Sequence[PlanTensor], partition_bytes: int, credit_bytes: int, *,
         slots: int | None = None, ordering: str = "dynamic", cost: CostModel | None = None,
         plan: "CommPlan | None" = None, lookahead_s: float = 0.0, shared_link: bool = False) -> Plan:
    """Replay the priority-and-credit queue and return the order it issues pieces in.

    Args:
        tensors: what to reduce; ``ready`` times as from :func:`backward_ready_times`.
        partition_bytes, credit_bytes: as in :class:`~commsched.config.SchedulerConfig`.
        slots: at most this many pieces in flight (None: only the credit limits).
        ordering: ``"dynamic"`` or ``"static"`` (priority among ready pieces; both
            give the same offline order) or ``"fifo"`` (ready order, priority ignored).
        cost: the link model (default :class:`CostModel`).
        plan: with ``ordering="planned"``, the :class:`commsched.plan.Plan` to replay;
            ``tensors`` are then its groups, by group name (see the module docstring).
        lookahead_s: with ``slots`` and ``dynamic``/``static``: a free slot is not given to
            the most urgent ready piece while at least as many pieces more urgent than it
            become ready within ``lookahead_s`` as there are free slots; they take the slots
            when they arrive. 0 (default): the scheduler's own rule, work-conserving. For a
            graph, whose chains are fixed for every step: a chain's next piece waits for the
            *completion* of the piece before it, and concurrent collectives share the link,
            so a slot given away is held for about ``credit / link`` seconds, not for one
            piece's link time as a serial link has it (:func:`graph_lookahead_s`).
        shared_link: the pieces in flight share the link equally (processor sharing: so
            TensorFlow's concurrent collectives measured, finishing about together) instead of
            using it one after another in issue order (default: the scheduler's engines, which
            run one collective at a time per group).

    Raises ``ValueError`` for sizes or slots that are not positive or an unknown ordering;
    :class:`~commsched.errors.OrderAgreementError` for a tensor the plan has no group for.
    """
    if ordering not in ORDERINGS:
        raise ValueError(f"ordering={ordering!r} is not a known ordering; use one of {', '.join(ORDERINGS)}")
    if partition_bytes <= 0 or credit_bytes <= 0:
        raise ValueError(f"partition_bytes and credit_bytes must be positive, got {partition_bytes}, {credit_bytes}")
    if slots is not None and slots < 1:
        raise ValueError(f"slots={slots!r} must be at least 1 (or None for no limit)")
    if not lookahead_s >= 0:
        raise ValueError(f"lookahead_s={lookahead_s!r} must be >= 0 seconds (0: no lookahead)")
    if (plan is None) != (ordering != "planned"):
        raise ValueError("replay: ordering='planned' needs plan=<a commsched.plan.Plan>, and plan= is only read "
                         f"with ordering='planned' (got ordering={ordering!r})")
    cost = cost or CostModel()
    policy = replay_policy(ordering, credit_bytes, plan)  # the scheduler's own rule, on a modelled clock
    lookahead = lookahead_s > 0 and slots is not None and isinstance(policy, PriorityPolicy)
    sending: list[list] = []  # shared_link: [bytes left, slot, nbytes, index into out] of each piece on the link
    unstarted = Unstarted()  # (the policy needs it to look up pieces only when agreeing with rank 0)

    # Submission order: tensors enter the queue as they become ready (stable on ties).
    arrival = sorted(range(len(tensors)), key=lambda i: (tensors[i].ready, i))

    def held_for_coming(queue: PriorityPolicy, coming: Sequence[int], until: float, free: int) -> bool:
        """Keep the free slots: as many pieces more urgent than the queue's head arrive by ``until``."""
        keys = queue.queued_keys()
        if not keys:
            return False
        head = min(keys)[1]  # its priority (the key is (step, priority, seq, index), one step here)
        count = 0
        for i in coming:  # in ready order
            t = tensors[i]
            if t.ready > until:
                break
            if t.priority < head:
                count += len(piece_bounds(t.numel, t.element_size, partition_bytes))
                if count >= free:
                    return True
        return False

    seq_of = {t: s for s, t in enumerate(arrival)}
    in_flight: list[tuple[float, int, int]] = []  # heap of (finish, slot, nbytes)
    free_slots = list(range(slots)) if slots is not None else []
    slot_free_at = {s: 0.0 for s in free_slots}
    in_flight_bytes = 0
    link_free = 0.0
    now = 0.0
    next_arrival = 0
    out: list[PlannedPiece] = []

    def admit(upto: float) -> None:
        nonlocal next_arrival
        while next_arrival < len(arrival) and tensors[arrival[next_arrival]].ready <= upto:
            i = arrival[next_arrival]
            t = tensors[i]
            task = Task(name=t.name, tensor=i, priority=t.priority, step=0, seq=seq_of[i], future=None,
                        on_done=None, submitted_us=0.0)  # the scheduler's own types; tensor: its index here
            bounds = policy.bounds_for(t.name, t.numel, t.element_size)  # planned: the group's piece size
            if bounds is None:
                bounds = piece_bounds(t.numel, t.element_size, partition_bytes)
            for index, (lo, hi) in enumerate(bounds):
                name = f"{t.name}#{index}"
                policy.add(Piece(task, index, lo, hi, (hi - lo) * t.element_size, None, name,
                                 algorithm=policy.algorithm_of(name)))
            next_arrival += 1

    while True:
        admit(now)
        while in_flight and in_flight[0][0] <= now:
            _, slot, nbytes = heapq.heappop(in_flight)
            in_flight_bytes -= nbytes
            if slots is not None:
                free_slots.append(slot)
        # Issue while the policy lets the most urgent ready piece go (head-of-line, as the scheduler).
        while not (slots is not None and not free_slots):
            if lookahead and held_for_coming(policy, arrival[next_arrival:], now + lookahead_s, len(free_slots)):
                break
            piece = policy.next(unstarted, 0, in_flight_bytes)
            if piece is None:
                break
            if slots is not None:
                # The slot that has been free longest (lowest number on ties): deterministic.
                slot = min(free_slots, key=lambda s: (slot_free_at[s], s))
                free_slots.remove(slot)
            else:
                slot = -1
            if shared_link:  # on the link with the others in flight; its finish is known when it ends
                sending.append([float(piece.nbytes), slot, piece.nbytes, len(out)])
                finish = now
            else:
                begin = max(now, link_free)
                link_free = begin + piece.nbytes / cost.link_bytes_per_s
                finish = link_free + cost.latency_s
                heapq.heappush(in_flight, (finish, slot, piece.nbytes))
            if slots is not None:
                slot_free_at[slot] = finish
            in_flight_bytes += piece.nbytes
            t = tensors[piece.task.tensor]
            out.append(PlannedPiece(tensor=piece.task.tensor, index=piece.index, name=piece.name, start=piece.start,
                                    stop=piece.stop, nbytes=piece.nbytes, priority=t.priority, seq=piece.task.seq,
                                    slot=slot, ready=t.ready, issue=now, finish=finish, algorithm=piece.algorithm))
        events = []
        if next_arrival < len(arrival):
            events.append(tensors[arrival[next_arrival]].ready)
        if in_flight:
            events.append(in_flight[0][0])
        if sending:  # the first to finish at an equal share of the link
            share = cost.link_bytes_per_s / len(sending)
            first = min(r[0] for r in sending)
            events.append(now + first / share)
        if not events:
            break
        later = max(now, min(events))
        if sending:
            sent = (later - now) * share
            if later >= now + first / share:  # its end is this event: exactly, whatever the clock's rounding
                sent = max(sent, first)
            still = []
            for r in sending:
                r[0] -= sent
                if r[0] > 1e-6 * r[2]:
                    still.append(r)
                    continue
                finish = later + cost.latency_s
                heapq.heappush(in_flight, (finish, r[1], r[2]))
                out[r[3]] = dataclasses.replace(out[r[3]], finish=finish)
                if slots is not None:
                    slot_free_at[r[1]] = finish
            sending = still
        now = later
    if plan is not None and len(out) != len(plan.pieces):
        from commsched.errors import OrderAgreementError

        given = {t.name for t in tensors}
        missing = [g.name for g in plan.groups if g.name not in given] or sorted({p.task for p in plan.pieces})
        raise OrderAgreementError(f"replay: no gradient was given for the plan's groups {missing[:10]}; a plan "
                                  "reduces every one of its groups every step")
    return Plan(pieces=tuple(out), credit_bytes=credit_bytes, partition_bytes=partition_bytes, slots=slots,
                ordering=ordering)
