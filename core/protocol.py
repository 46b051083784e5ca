"""Order agreement on the wire: the control messages, and the channel that carries them.

gloo, NCCL and TF collectives match operations by issue order, so under
``dynamic`` and ``static`` ordering rank 0 decides and the other ranks (followers)
issue exactly what it decided. Decisions travel through the rendezvous store: one
FIFO queue per follower (``<prefix>/q<rank>``), which the follower pops (blocking,
no polling; a pop removes what was read, so nothing accumulates). Messages are
batched, one per line:

=======  =========================  ==============================================
message  line                       meaning
=======  =========================  ==============================================
P        ``P\\t<step>\\t<piece>``     rank 0 started piece ``<piece>`` of ``<step>`` (``decide_ahead``:
                                   or will start it, after the pieces published before it)
E        ``E\\t<step>``               every piece of ``<step>`` started on rank 0
L        ``L\\t0\\t<p1>\\x1f<p2>...``   the static plan: step 0's order, for every later step
A        ``A\\t<message>``            a rank failed (also in the ``<prefix>/abort`` key)
C        ``C``                      the follower's own ``close()`` wakes its reader
=======  =========================  ==============================================

The other way, with ``SchedulerConfig.ready_reports`` under ``dynamic``: every follower pushes to one
queue that rank 0 pops (``<prefix>/ready``) a line per gradient as it becomes ready there, and rank 0
starts a piece once its gradient is ready on every rank (:class:`commsched.policy.LeaderPolicy`):

=======  ===============================  ========================================
R        ``R\\t<step>\\t<rank>\\t<task>``  gradient ``<task>`` of ``<step>`` is ready on ``<rank>``
C        ``C``                            rank 0's own ``close()`` wakes its report reader
=======  ===============================  ========================================

Names never hold tabs, newlines or ``\\x1f`` (``Scheduler.submit`` refuses them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from commsched.store import Store

__all__ = ["Abort", "Channel", "Close", "Decision", "EndOfStep", "Lost", "Message", "Plan", "Ready", "decode",
           "encode", "publish_loop", "read_loop"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """Rank 0 started ``piece`` of ``step`` (or, deciding ahead, will start it after the ones before it)."""

    step: int
    piece: str


@dataclass(frozen=True)
class EndOfStep:
    """Every piece of ``step`` started on rank 0."""

    step: int


@dataclass(frozen=True)
class Plan:
    """The static plan: the order of step 0's pieces, to be repeated every later step."""

    pieces: tuple[str, ...]


@dataclass(frozen=True)
class Ready:
    """A follower's report to rank 0: gradient ``task`` of ``step`` is ready on ``rank``."""

    step: int
    rank: int
    task: str


@dataclass(frozen=True)
class Abort:
    """Another rank failed; ``message`` says why."""

    message: str


@dataclass(frozen=True)
class Close:
    """The follower's own ``close()``: its reader stops."""


@dataclass(frozen=True)
class Lost:
    """Not on the wire: the follower's reader lost the store (``error``). Not an error yet,
    rank 0 may simply have finished first; it becomes one if pieces still wait for rank 0."""

    error: BaseException


Message = Union[Decision, EndOfStep, Plan, Ready, Abort, Close, Lost]


def encode(messages: list[Message]) -> bytes:
    """One batch of messages as the bytes pushed to a follower's queue."""
    lines = []
    for m in messages:
        if isinstance(m, Decision):
            lines.append(f"P\t{m.step}\t{m.piece}")
        elif isinstance(m, EndOfStep):
            lines.append(f"E\t{m.step}")
        elif isinstance(m, Plan):
            lines.append("L\t0\t" + "\x1f".join(m.pieces))
        elif isinstance(m, Ready):
            lines.append(f"R\t{m.step}\t{m.rank}\t{m.task}")
        elif isinstance(m, Abort):
            lines.append(f"A\t{m.message}")
        elif isinstance(m, Close):
            lines.append("C")
        else:
            raise TypeError(f"not an order-agreement message: {m!r}")
    return "\n".join(lines).encode()


def decode(raw: bytes) -> list[Message]:
    """The messages of one batch. An abort's message may hold newlines: it is always alone."""
    text = raw.decode()
    if text == "C":
        return [Close()]
    if text.startswith("A\t"):
        return [Abort(text[2:])]
    out: list[Message] = []
    for line in text.split("\n"):
        kind, step, rest = (line.split("\t", 2) + ["", ""])[:3]
        if kind == "P":
            out.append(Decision(int(step), rest))
        elif kind == "E":
            out.append(EndOfStep(int(step)))
        elif kind == "L":
            out.append(Plan(tuple(rest.split("\x1f")) if rest else ()))
        elif kind == "R":
            rank, _, task = rest.partition("\t")
            out.append(Ready(int(step), int(rank), task))
        else:
            raise ValueError(f"unknown order-agreement message {line!r}")
    return out


class Channel:
    """Rank 0's decisions to the followers, the followers' ready reports to rank 0, and every rank's
    abort notice, over a :class:`Store`."""

    def __init__(self, store: Store, prefix: str, rank: int, world_size: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size

    def _key(self, what: str) -> str:
        return f"{self.prefix}/{what}"

    def publish(self, messages: list[Message]) -> None:
        """Rank 0: push one batch to every follower's queue."""
        payload = encode(messages)
        for rank in range(1, self.world_size):
            self.store.push(self._key(f"q{rank}"), payload)

    def receive(self, timeout_s: float) -> list[Message]:
        """A follower: the next batch from its queue (blocking up to ``timeout_s``; ``TimeoutError``)."""
        return decode(self.store.pop(self._key(f"q{self.rank}"), timeout_s))

    def report(self, messages: list[Message]) -> None:
        """A follower: push one batch of ready reports to rank 0's queue (one queue for every follower)."""
        self.store.push(self._key("ready"), encode(messages))

    def receive_reports(self, timeout_s: float) -> list[Message]:
        """Rank 0: the next batch of the followers' ready reports (blocking up to ``timeout_s``; ``TimeoutError``)."""
        return decode(self.store.pop(self._key("ready"), timeout_s))

    def wake(self) -> None:
        """This rank's ``close()``: wake its own reader, blocked in :meth:`receive` (a follower) or
        :meth:`receive_reports` (rank 0), best effort."""
        try:
            self.store.push(self._key("ready" if self.rank == 0 else f"q{self.rank}"), encode([Close()]))
        except Exception as exc:  # the store is gone: the reader has stopped already
            log.debug("could not wake the order reader: %r", exc)

    def publish_abort(self, message: str, wake_followers: bool) -> None:
        """Tell every rank that this one failed (best effort: the store may be gone too)."""
        try:
            self.store.set(self._key("abort"), message.encode())
            if wake_followers:  # their order readers block in a pop
                for rank in range(1, self.world_size):
                    if rank != self.rank:
                        self.store.push(self._key(f"q{rank}"), encode([Abort(message)]))
        except Exception as exc:
            log.debug("could not publish the abort: %r", exc)

    def close(self) -> None:
        """This rank's scheduler closed. The last rank to close deletes the channel's keys: the
        followers' queues, the abort notice and the close count itself, so a job whose ranks all
        close leaves nothing in the store. A rank that died never counts: its job keeps the abort
        notice (why the others stopped) and the count, two keys. Best effort: the store may be
        gone, or lack ``add``."""
        add = getattr(self.store, "add", None)
        if add is None or self.world_size < 2:
            return
        try:
            if add(self._key("closed"), 1) < self.world_size:
                return
            for what in ["abort", "ready", *(f"q{rank}" for rank in range(1, self.world_size)), "closed"]:
                self.store.delete(self._key(what))
        except Exception as exc:  # the store's host may have exited first
            log.debug("could not clean the channel's keys: %r", exc)

    def abort_message(self, grace_s: float = 0.0) -> str | None:
        """Another rank's abort message, waiting up to ``grace_s`` for it to arrive."""
        deadline = time.monotonic() + grace_s
        try:
            while not self.store.check(self._key("abort")):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)  # failure path only: the other rank is publishing why it stopped
            return self.store.get(self._key("abort"), 1.0).decode()
        except Exception:
            return None


def publish_loop(channel: Channel, take: Callable[[], Optional[list[Message]]]) -> None:
    """The ``publish`` thread: push every batch ``take()`` returns (it blocks for the next one)
    until it returns None (closing): rank 0's decisions to the followers, a follower's ready
    reports to rank 0."""
    failed = False
    while True:
        batch = take()
        if batch is None:
            return
        if channel.rank == 0:
            channel.publish(batch)
            continue
        try:
            channel.report(batch)
        except Exception as exc:  # rank 0 (the store's host) is gone: the order thread says so (Lost);
            if not failed:  # the batch is dropped (rank 0 then starts such pieces when its link is idle)
                log.debug("could not report ready gradients to rank 0: %r", exc)
            failed = True


def read_loop(channel: Channel, timeout_s: float, reading: Callable[[], bool],
              deliver: Callable[[list[Message]], None], aborted: Callable[[str], None]) -> None:
    """The ``order`` thread: hand each batch to ``deliver`` while ``reading()``: a follower's
    decisions from rank 0, rank 0's ready reports from the followers. Stop at this rank's own
    close marker, at another rank's abort (``aborted(message)``), or when the store goes away
    (delivers :class:`Lost`)."""
    receive = channel.receive if channel.rank != 0 else channel.receive_reports
    while reading():
        try:
            messages = receive(timeout_s)
        except TimeoutError:
            continue  # idle (evaluation, say); the user's waits have their own timeouts
        except Exception as exc:  # the store went away (process group destroyed, rank 0 gone)
            deliver([Lost(exc)])
            return
        if isinstance(messages[0], Close):
            return
        if isinstance(messages[0], Abort):
            aborted(messages[0].message)
            return
        deliver(messages)
