"""What each kind of failure is called, in one place.

The scheduler has one failed state (``Scheduler.error``): the first error wins,
every pending future fails with it, it is raised at the next call of the user's
thread, and it is published to the other ranks (:meth:`commsched.protocol.Channel.publish_abort`).
These functions build the error for each way of getting there, so that the
message says what failed, where, and what to do.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from commsched.errors import CommschedError, CommunicationError, OrderAgreementError, RemoteAbort
from commsched.protocol import Channel

__all__ = ["FailedState", "background_failed", "piece_failed", "refused", "remote_abort", "update_failed"]


class FailedState:
    """The first error wins and is kept; other ranks hear of it (unless it came from one).

    The notice goes out on a thread of its own (``commsched-abort-r<rank>``), since the
    store may be slow or gone; :meth:`join` waits for it at close.
    """

    def __init__(self, channel: Optional[Channel], rank: int, wake_followers: bool) -> None:
        self.error: BaseException | None = None
        self._channel, self._rank, self._wake = channel, rank, wake_followers
        self._thread: threading.Thread | None = None

    def enter(self, error: BaseException) -> bool:
        """Fail with ``error``; False if already failed (the first error stays)."""
        if self.error is not None:
            return False
        self.error = error
        if self._channel is not None and self._channel.world_size > 1 and not isinstance(error, RemoteAbort):
            self._thread = threading.Thread(target=self._channel.publish_abort,
                                            args=(f"rank {self._rank}: {error}", self._wake),
                                            name=f"commsched-abort-r{self._rank}", daemon=False)
            self._thread.start()
        return True

    def threads(self) -> list[threading.Thread]:
        return [self._thread] if self._thread is not None else []


def _caused(error: CommschedError, cause: BaseException | None) -> CommschedError:
    if cause is not None:
        error.__cause__ = cause
    return error


def remote_abort(message: str, cause: BaseException | None = None) -> RemoteAbort:
    """Another rank stopped and published ``message``."""
    error = RemoteAbort(f"another rank failed, so this one stops too: {message}")
    return _caused(error, cause)  # type: ignore[return-value]


def piece_failed(piece: Any, exc: BaseException, rank: int, remote: str | None) -> CommschedError:
    """The engine failed ``piece``; if another rank published why it stopped, that is the error."""
    if remote is not None:
        return remote_abort(remote, exc)
    task = piece.task
    return _caused(CommunicationError(
        f"reducing tensor {task.name!r} (piece {piece.index}, elements {piece.start}:{piece.stop}) failed on rank "
        f"{rank}: {exc}", tensor=task.name, piece=piece.index), exc)


def refused(task_name: str, exc: BaseException) -> CommschedError:
    """A tensor handed over from an engine thread (``Ticket.ready``) could not be taken."""
    if isinstance(exc, CommschedError):
        return exc
    return _caused(CommschedError(f"tensor {task_name!r} cannot be reduced: {exc}"), exc)


def update_failed(task_name: str, exc: BaseException) -> CommschedError:
    """The plugin's ``on_done`` (the update after a reduction) raised. A disagreement it found (the
    check of :mod:`commsched.order_check`) is raised as itself: it names what differs already."""
    if isinstance(exc, OrderAgreementError):
        return exc
    return _caused(CommschedError(f"the update after reducing tensor {task_name!r} failed: {exc!r}"), exc)


def background_failed(thread_name: str, exc: BaseException) -> CommschedError:
    """A scheduler thread died: a bug, or an engine that raised where it should have reported."""
    if isinstance(exc, CommschedError):
        return exc
    return _caused(CommschedError(f"commsched background thread {thread_name} failed: {exc!r}"), exc)
