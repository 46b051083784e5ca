"""The CUDA side of the torch plugin: one communication stream per device, readiness and
completion as CUDA events, buffers released by stream.

Why events and not the engine's future: on NCCL ``work.get_future()`` completes when the
all-reduce is *queued*, so releasing credit there would let every piece go straight to
NCCL in submission order (credit and priority would do nothing), and a CPU ``work.wait()``
returns at once, so the measured bubble would be ~0. Here:

1. backward (compute stream): :meth:`DeviceStreams.record_ready` records the *ready* event
   right after the gradient is produced;
2. dispatch thread: :meth:`DeviceStreams.start_on_comm_stream` makes the communication
   stream wait for the ready event, issues the collective on it and records the piece's
   *completion* event; the buffer is marked in use by that stream
   (:meth:`DeviceStreams.release_when_done`, ``Tensor.record_stream``) so the caching
   allocator never hands its memory out before the collective finished, whoever frees it;
3. once a task's last piece is issued, :meth:`DeviceStreams.finish_on_comm_stream`
   enqueues the division (average) on the communication stream and records the task's
   *done* event;
4. the backend's completion thread calls the scheduler's ``done`` only when the piece's
   completion event has completed (:meth:`DeviceStreams.is_done`): that releases credit;
5. next forward (compute stream): :meth:`DeviceStreams.wait_event` makes the compute stream
   wait for the done event (no CPU block), then the update is enqueued behind it; the
   stall is measured on the GPU with timing events (:meth:`DeviceStreams.elapsed_s`).

Only the dispatch thread issues collectives (one process group, one thread); the
completion thread only queries events. Everything goes through an ``api`` object
(:class:`TorchCuda`, or :class:`FakeCuda` in tests) so the order of waits, records and
releases is testable on a CPU.

This path has not run on a GPU yet; ``scripts/gpu_check.sh`` is how to check it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["CudaTask", "DeviceStreams", "FakeCuda", "TorchCuda"]


class TorchCuda:
    """The real ``torch.cuda`` calls :class:`DeviceStreams` makes."""

    fake = False

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def new_event(self, timing: bool) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class _FakeStream:
    def __init__(self, api: "FakeCuda", name: str) -> None:
        self.api, self.name = api, name

    def wait_event(self, event: "_FakeEvent") -> None:
        self.api.log.append(("wait", self.name, event.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class _FakeEvent:
    def __init__(self, api: "FakeCuda", name: str, timing: bool) -> None:
        self.api, self.name, self.timing = api, name, timing
        self.stream: Optional[str] = None
        self.tick: Optional[int] = None  # the fake clock when the stream reached it
        self.completed = False
        self.queries = 0

    def record(self, stream: _FakeStream) -> None:
        self.stream = stream.name
        self.tick = next(self.api.clock)
        self.completed = self.api.auto_complete
        self.api.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        with self.api.cv:
            self.queries += 1
            self.api.cv.notify_all()
        return self.completed

    def complete(self, tick: Optional[int] = None) -> None:
        """The (fake) GPU reached this event, at ``tick`` on the fake clock if given."""
        if tick is not None:
            self.tick = tick
        self.completed = True

    def synchronize(self) -> None:
        self.completed = True  # a CPU wait until the (fake) GPU got here

    def elapsed_time(self, end: "_FakeEvent") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs two timing events")
        return float(end.tick - self.tick)  # one tick = 1 ms


class FakeCuda:
    """A CPU stand-in for :class:`TorchCuda`: streams and events that only log what is done to them.

    ``log`` holds ``("wait", stream, event)``, ``("record", stream, event)``,
    ``("enter", stream)``/``("exit", stream)`` around work issued on a stream, and
    ``("release", stream, tensor_id)``. Events complete when a test calls
    ``event.complete()`` (or at once with ``auto_complete=True``); ``events`` maps names to
    events; the compute stream of every device is ``"compute"``.
    """

    fake = True

    def __init__(self, auto_complete: bool = False) -> None:
        self.auto_complete = auto_complete
        self.log: list[tuple] = []
        self.events: dict[str, _FakeEvent] = {}
        self.clock = itertools.count(1)
        self.cv = threading.Condition()
        self._names = itertools.count()
        self._compute = _FakeStream(self, "compute")

    def new_stream(self, device: Any) -> _FakeStream:
        return _FakeStream(self, f"comm:{device}")

    def new_event(self, timing: bool) -> _FakeEvent:
        event = _FakeEvent(self, f"e{next(self._names)}", timing)
        self.events[event.name] = event
        return event

    @contextlib.contextmanager
    def use_stream(self, stream: _FakeStream) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.log.append(("exit", stream.name))

    def current_stream(self, device: Any) -> _FakeStream:
        return self._compute

    def record_stream(self, tensor: torch.Tensor, stream: _FakeStream) -> None:
        self.log.append(("release", stream.name, id(tensor)))

    def wait_queried(self, event: _FakeEvent, times: int, timeout: float = 30.0) -> bool:
        """Block until ``event`` was queried at least ``times`` times (a test's synchronisation)."""
        with self.cv:
            return self.cv.wait_for(lambda: event.queries >= times, timeout)


class DeviceStreams:
    """One communication stream per device and the event operations on it (see the module docstring).

    Thread-safe: the dispatch thread, the completion thread and the user's thread share it.
    """

    def __init__(self, api: Any = None) -> None:
        self.api = api if api is not None else TorchCuda()
        self._streams: dict[Any, Any] = {}
        self._lock = threading.Lock()

    @property
    def fake(self) -> bool:
        """True for a :class:`FakeCuda` (then CPU tensors take this path too, for tests)."""
        return bool(getattr(self.api, "fake", False))

    def comm_stream(self, device: Any) -> Any:
        """The communication stream of ``device`` (created once)."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = self.api.new_stream(device)
            return stream

    def current_stream(self, device: Any) -> Any:
        """The stream the user's thread issues to on ``device`` (the compute stream)."""
        return self.api.current_stream(device)

    def record_ready(self, tensor: torch.Tensor) -> Any:
        """An event recorded now on the current (compute) stream: ``tensor`` is written when it completes."""
        event = self.api.new_event(False)
        event.record(self.api.current_stream(tensor.device))
        return event

    def start_on_comm_stream(self, tensor: torch.Tensor, ready_event: Any,
                             collective: Callable[[], Any]) -> tuple[Any, Any]:
        """Run ``collective()`` on ``tensor``'s communication stream after ``ready_event``.

        Returns ``(work, completion_event)``: what the collective returned and an event that
        completes when the collective has finished on the GPU. ``tensor`` stays allocated
        until then (:meth:`release_when_done`)."""
        stream = self.comm_stream(tensor.device)
        if ready_event is not None:
            self.wait_event(stream, ready_event)  # before the collective: the data is written
        with self.api.use_stream(stream):
            work = collective()
        completion = self.api.new_event(False)
        completion.record(stream)
        self.release_when_done(tensor, stream)
        return work, completion

    def finish_on_comm_stream(self, tensor: torch.Tensor, divisor: Optional[float]) -> Any:
        """Enqueue ``tensor /= divisor`` (if given) on the communication stream, behind every
        collective issued on ``tensor`` so far; returns a timing event recorded after it."""
        stream = self.comm_stream(tensor.device)
        if divisor is not None:
            with self.api.use_stream(stream):
                tensor.div_(divisor)
        done = self.api.new_event(True)
        done.record(stream)
        return done

    def is_done(self, event: Any) -> bool:
        """Whether the GPU has passed ``event`` (``cudaEventQuery``; never blocks)."""
        return bool(event.query())

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` on the GPU (the CPU does not block)."""
        stream.wait_event(event)

    def mark(self, stream: Any) -> Any:
        """A timing event recorded now on ``stream``."""
        event = self.api.new_event(True)
        event.record(stream)
        return event

    def release_when_done(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``: its memory is not reused
        before the work queued on ``stream`` so far has finished, whichever stream frees it.
        (``record_stream`` takes the stream; the completion event recorded on it marks the same point.)"""
        self.api.record_stream(tensor, stream)

    def elapsed_s(self, start: Any, end: Any) -> float:
        """GPU seconds from ``start`` to ``end`` (both timing events, both completed); 0 if ``end`` came first."""
        return max(0.0, float(start.elapsed_time(end)) / 1000.0)


class CudaTask:
    """What the plugin passes as ``submit(..., ready=...)`` for a tensor on the stream/event path.

    ``ready_event``: the gradient is written; ``divisor``: the average's division (None for a
    sum), enqueued on the communication stream after the last piece; ``done_event``: recorded
    after it. The backend calls :meth:`issued` from the dispatch thread for each piece it put on
    the stream; the user's thread waits in :meth:`wait_issued` (a CPU wait only until every piece
    is *queued*, not until it finished) and then waits on ``done_event`` on the GPU.
    """

    __slots__ = ("streams", "ready_event", "divisor", "done_event", "issued_pieces", "_cv")

    def __init__(self, streams: DeviceStreams, ready_event: Any, divisor: Optional[float]) -> None:
        self.streams = streams
        self.ready_event = ready_event
        self.divisor = divisor
        self.done_event: Any = None
        self.issued_pieces = 0
        self._cv = threading.Condition()

    def issued(self, tensor: torch.Tensor, total: int) -> None:
        """One more piece of ``tensor`` (``total`` in all) is on the communication stream; after the
        last one, enqueue the division and record ``done_event``."""
        with self._cv:
            self.issued_pieces += 1
            if self.issued_pieces == total:
                self.done_event = self.streams.finish_on_comm_stream(tensor, self.divisor)
                self._cv.notify_all()

    def wait_issued(self, timeout: float) -> bool:
        """True once ``done_event`` exists (every piece queued, the division too); False after ``timeout`` s."""
        with self._cv:
            return self._cv.wait_for(lambda: self.done_event is not None, timeout)
