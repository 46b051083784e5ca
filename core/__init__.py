"""commsched: a communication scheduler for data-parallel training.

The core is framework-neutral: it partitions tensors into pieces, orders them by
priority, paces them with a credit window and makes every rank agree on the
order. Plugins (``commsched.plugins.torch``, ``.tensorflow``, ``.mxnet``) connect it
to a framework and a collective engine.
"""

from commsched._version import __version__
from commsched.config import SchedulerConfig
from commsched.errors import (
    CommschedError,
    CommschedTimeout,
    CommunicationError,
    HorovodUnavailable,
    OrderAgreementError,
    RemoteAbort,
    SchedulerClosed,
)
from commsched.scheduler import Backend, Piece, Scheduler, Task, Ticket

__all__ = [
    "Backend",
    "CommschedError",
    "CommschedTimeout",
    "CommunicationError",
    "HorovodUnavailable",
    "OrderAgreementError",
    "Piece",
    "RemoteAbort",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerConfig",
    "Task",
    "Ticket",
    "__version__",
]
