"""What the scheduler works on: the engine contract, tasks, their pieces, reservations.

Plugins implement :class:`Backend`; the scheduler hands them :class:`Piece` objects
(zero-copy views of a :class:`Task`'s tensor) and gives :class:`Ticket` objects for
tensors announced before their data is ready.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:
    from commsched.scheduler import Scheduler

__all__ = ["Backend", "Piece", "Task", "Ticket", "check_name"]


class Backend(Protocol):
    """The collective engine under the scheduler (provided by a plugin).

    ``start(piece, done)`` begins an in-place sum-all-reduce (or push/pull) of
    ``piece.view`` and returns without waiting; the engine later calls ``done(None)``
    or ``done(exception)`` exactly once, from any thread. ``negotiates_order`` is True
    for engines that match operations by name (Horovod): then only rank 0 paces by
    priority and credit. ``close()`` releases what the engine holds (threads,
    groups); :meth:`Scheduler.close` calls it once, after its own threads stopped
    (so does interpreter exit for a scheduler the user forgot). Safe to call twice.

    An engine may also have ``starts_in_done`` (read with ``getattr``, default False): True
    when the thread that calls ``done`` may call ``start`` again (gloo's callbacks; not a
    thread that must only poll, like the CUDA watcher). The scheduler then starts what a
    completion's credit freed on that thread (``SchedulerConfig.direct_start``).
    """

    rank: int
    world_size: int
    negotiates_order: bool

    def start(self, piece: "Piece", done: Callable[[Optional[BaseException]], None]) -> None: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Task:
    """One submitted tensor; ``future`` resolves to the tensor once every piece is reduced.

    ``ready`` is what the plugin passed to :meth:`Scheduler.submit` to say when the data
    is ready on the device (a CUDA event, say); the backend may wait on it. ``handles``
    is where a backend keeps the engine's handles of this task's pieces, for a plugin
    that must order later work after them. ``on_piece(piece)``, if set, runs on the engine's
    thread as each piece lands, before the task can complete (:meth:`Scheduler.submit`).
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
    on_piece: Optional[Callable[["Piece"], None]] = None


@dataclass(eq=False)
class Piece:
    """A contiguous slice ``[start, stop)`` of a task's flattened tensor, as a zero-copy ``view``.

    ``algorithm`` is how the backend should all-reduce it: ``"ring"`` (the engine's own
    all-reduce, the default) or ``"hierarchical"`` (intra-node reduce-scatter, inter-node
    all-reduce of the shard, intra-node all-gather; set by ``ordering="planned"``). A backend
    without a two-level algorithm treats every piece as ``"ring"``.
    """

    task: Task
    index: int
    start: int
    stop: int
    nbytes: int
    view: Any
    name: str
    done: bool = False
    issued_us: float = 0.0
    algorithm: str = "ring"
    #: (``landed_at`` of its step in the scheduler's counters' ``issue_times``, its index there)
    stat_slot: tuple[list, int] | None = None

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.task.step, self.task.priority, self.task.seq, self.index)


class Ticket:
    """A tensor announced by :meth:`Scheduler.reserve` whose data is not ready yet.

    ``future`` resolves like the future of :meth:`Scheduler.submit`. Call :meth:`ready`
    once, from any thread, when the data is written.
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
        """The data is ready: hand ``tensor`` over. Never raises (it runs on engine threads):
        an error fails the scheduler, the future and the next user call."""
        self._scheduler._ticket_ready(self.task, tensor)


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or "\t" in name or "\n" in name or "\x1f" in name:
        raise ValueError(f"tensor name {name!r} must be a non-empty str without tabs or newlines")
