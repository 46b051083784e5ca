"""Exceptions raised by commsched. All derive from :class:`CommschedError`."""

from __future__ import annotations

from typing import Iterable

__all__ = [
    "CommschedError",
    "CommschedTimeout",
    "CommunicationError",
    "HorovodUnavailable",
    "OrderAgreementError",
    "RemoteAbort",
    "SchedulerClosed",
]


class CommschedError(RuntimeError):
    """Base class of every error commsched raises on purpose."""


class SchedulerClosed(CommschedError):
    """Work was given to a scheduler after ``close()``, or was still pending when it closed."""


class CommunicationError(CommschedError):
    """A piece failed in the collective engine (or a rank it needed is gone).

    ``tensor`` and ``piece`` name what failed; ``__cause__`` holds the engine's error.
    """

    def __init__(self, message: str, tensor: str | None = None, piece: int | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.piece = piece


class HorovodUnavailable(CommschedError, ImportError):
    """``backend="horovod"`` was asked for, but Horovod with this framework's support cannot be imported.

    Every plugin raises this same type (it is also an ``ImportError``); the message says
    how to get Horovod.
    """


class OrderAgreementError(CommschedError):
    """Ranks disagree on what to communicate (a tensor seen on one rank but not another)."""


class RemoteAbort(CommschedError):
    """Another rank failed and told this one through the rendezvous store."""


class CommschedTimeout(CommschedError, TimeoutError):
    """A wait ran past its timeout. ``pending`` lists the pieces still outstanding."""

    def __init__(self, what: str, timeout_s: float, pending: Iterable[str] = ()) -> None:
        self.pending = list(pending)
        shown = ", ".join(self.pending[:20]) + (" ..." if len(self.pending) > 20 else "")
        detail = f"; {len(self.pending)} piece(s) still pending: {shown}" if self.pending else ""
        super().__init__(
            f"{what} did not finish within {timeout_s:g} s{detail}. A rank may be stuck or dead, "
            "or the network too slow for this timeout: raise SchedulerConfig(timeout_s=...) or "
            "COMMSCHED_TIMEOUT_S if progress is just slow."
        )
        self.timeout_s = timeout_s
