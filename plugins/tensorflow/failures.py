"""TensorFlow's errors of commsched's pieces, as commsched's errors.

A worker that dies or hangs makes the others fail inside one of commsched's
collectives, but TensorFlow raises its own ``UnavailableError`` /
``DeadlineExceededError`` / ``CancelledError`` from whatever ran the graph. Where
commsched is on the call path it raises its own class instead, with the TF error as
``__cause__``:

* eagerly, from ``apply_gradients`` / ``tape.gradient`` (the reducer runs the pieces);
* in a graph, from a step compiled with :func:`commsched.plugins.tensorflow.function`
  (or :func:`~commsched.plugins.tensorflow.unroll`): a plain ``tf.function`` runs the
  graph without commsched on the call path, so its caller sees TF's error
  (:func:`commsched_error` translates one afterwards).

The mapping, the same one the torch plugin gives for a lost peer:

=========================================  ==============================================
TensorFlow error naming a ``commsched_`` op  commsched error
=========================================  ==============================================
``DeadlineExceededError``                  :class:`~commsched.errors.CommschedTimeout`
                                           (``pending`` names the piece)
``UnavailableError``, ``CancelledError``,  :class:`~commsched.errors.CommunicationError`
``AbortedError``, ``InternalError``         (``tensor``, ``piece``)
=========================================  ==============================================

A commsched error that AutoGraph wrapped while a function was traced (a
``StagingError`` whose context is the commsched error) is unwrapped to that error.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import tensorflow as tf

from commsched.errors import CommschedError, CommschedTimeout, CommunicationError

__all__ = ["TracedTimeout", "commsched_error", "piece_error", "register_op"]

# "[[{{node sgd/commsched_2_dense_kernel_1}}]]" in a function's error, "name: commsched_..." eagerly.
_NODE = re.compile(r"\{\{node (?:[^{}]*/)?(commsched_[^{}\s]*)\}\}|name: (?:[^\s]*/)?(commsched_[^\s]+)")
_LOST = (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError, tf.errors.InternalError)
_ops: dict[str, tuple[str, int, float]] = {}  # graph op name (last part) -> (piece name, rank, timeout_s)
_ops_lock = threading.Lock()
_MAX_OPS = 1 << 16


class TracedTimeout(CommschedTimeout):
    """A :class:`~commsched.errors.CommschedTimeout` that stays one when raised while a
    ``tf.function`` is traced: AutoGraph re-creates an error with its own message only
    when the class takes ``Exception``'s constructor, and turns any other into a
    ``StagingError``. ``pending`` and ``timeout_s`` are set on the instance raised (a
    re-created one has the class defaults)."""

    __init__ = Exception.__init__
    pending: tuple[str, ...] = ()
    timeout_s: float | None = None

    @classmethod
    def of(cls, error: CommschedTimeout) -> "TracedTimeout":
        traced = cls(str(error))
        traced.pending, traced.timeout_s = list(error.pending), error.timeout_s
        return traced


def register_op(op_name: str, piece: str, rank: int, timeout_s: float) -> None:
    """Remember that graph op ``op_name`` reduces ``piece`` (so its TF error can name the piece)."""
    with _ops_lock:
        if len(_ops) >= _MAX_OPS:  # retraces of huge models: forget the oldest names
            for old in list(_ops)[: _MAX_OPS // 2]:
                del _ops[old]
        _ops[op_name.rsplit("/", 1)[-1]] = (piece, rank, timeout_s)


def _split(piece: str) -> tuple[str, int | None]:
    tensor, _, index = piece.rpartition("#")
    return (tensor, int(index)) if tensor and index.isdigit() else (piece, None)


def piece_error(exc: tf.errors.OpError, piece: str, rank: int, timeout_s: float,
                op_name: str | None = None) -> CommschedError:
    """The commsched error for TF error ``exc`` of ``piece`` (``"<tensor>#<index>"``) on worker ``rank``."""
    tensor, index = _split(piece)
    where = f"piece {piece!r}" + (f" (TF op {op_name})" if op_name else "")
    first = _gist(exc)
    if isinstance(exc, tf.errors.DeadlineExceededError):
        error: CommschedError = CommschedTimeout(
            f"worker {rank}: the all-reduce of {where}", timeout_s, pending=[piece])
    else:
        error = CommunicationError(
            f"reducing {where} failed on worker {rank}: another worker is gone or unreachable "
            f"({type(exc).__name__}: {first}). TensorFlow's collective executor is aborted now: restart the job",
            tensor=tensor, piece=index)
    error.__cause__ = exc
    return error


def _gist(exc: tf.errors.OpError) -> str:
    """The line of a TF error that says why ("Collective ops is aborted by: ..."), not its preamble."""
    lines = [line.strip() for line in (exc.message or "").splitlines() if line.strip()]
    for line in lines:
        if "aborted by" in line or "timed out" in line:
            return line.split("}} ", 1)[-1]
    useful = [line for line in lines if not line.startswith("Graph execution error")]
    return (useful or [""])[0][:300]


def commsched_error(exc: BaseException) -> CommschedError | None:
    """The commsched error ``exc`` stands for, or None when it is not about commsched.

    ``exc`` itself when it is a :class:`~commsched.errors.CommschedError`; the commsched error
    AutoGraph wrapped (its context); for a TF error that names one of commsched's collectives,
    the error of :func:`piece_error` (its ``__cause__`` is ``exc``).
    """
    if isinstance(exc, TracedTimeout) and exc.timeout_s is None and isinstance(exc.__context__, CommschedError):
        return exc.__context__  # AutoGraph's re-creation: the original has the attributes
    if isinstance(exc, CommschedError):
        return exc
    context = exc.__context__
    if hasattr(exc, "ag_error_metadata") and isinstance(context, CommschedError):
        return context  # a StagingError (or other re-creation) around a commsched error
    if not isinstance(exc, tf.errors.OpError) or not isinstance(exc, (*_LOST, tf.errors.DeadlineExceededError)):
        return None
    match = _NODE.search(exc.message or "")
    if match is None:
        return None
    op_name = match.group(1) or match.group(2)
    with _ops_lock:
        known = _ops.get(op_name)
    if known is None:
        return _unknown(exc, op_name)
    piece, rank, timeout_s = known
    return piece_error(exc, piece, rank, timeout_s, op_name)


def _unknown(exc: tf.errors.OpError, op_name: str) -> CommschedError:
    """A commsched op this process did not register (a function traced in another process, say)."""
    first = _gist(exc)
    error = CommunicationError(f"commsched's all-reduce {op_name} failed: another worker is gone, unreachable or "
                               f"too slow ({type(exc).__name__}: {first}). TensorFlow's collective executor is "
                               "aborted now: restart the job")
    error.__cause__ = exc
    return error


def raise_translated(exc: BaseException) -> Any:
    """Raise the commsched error for ``exc`` (from ``exc``) if there is one; else re-raise ``exc``."""
    error = commsched_error(exc)
    if error is None or error is exc:
        raise exc
    raise error from error.__cause__  # the TF error (or nothing) as cause, AutoGraph's wrapper dropped
