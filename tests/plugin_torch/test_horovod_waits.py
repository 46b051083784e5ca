"""Every wait of the Horovod backend is bounded, even on a handle Horovod never completes.

Horovod's ``synchronize`` has no timeout, and when a peer dies a handle enqueued while
Horovod's background loop stops is never completed. These tests drive
:class:`HorovodBackend` with a fake ``horovod.torch`` whose handles complete, fail or
never finish on command, so each bound is checked without a second process. The
real-engine counterpart is the Horovod kill sample in ``test_faults.py``.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from commsched.errors import CommschedError, CommschedTimeout, CommunicationError
from commsched.plugins.torch import backends

TIMEOUT_S = 0.5


class FakeHorovod:
    """The calls HorovodBackend makes; ``finish(name, error=None)`` completes an operation."""

    Sum, Average = "sum", "average"

    def __init__(self, rank: int = 0, size: int = 2) -> None:
        self._rank, self._size = rank, size
        self._ops: dict[int, dict] = {}
        self._lock = threading.Lock()
        self.synchronized: list[str] = []

    def is_initialized(self) -> bool:
        return True

    def init(self) -> None:  # pragma: no cover - is_initialized() is True
        raise AssertionError("already initialised")

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _new(self, name: str, output=None) -> int:
        with self._lock:
            handle = len(self._ops) + 1
            self._ops[handle] = {"name": name, "done": False, "error": None, "output": output}
            return handle

    def allreduce_async_(self, tensor, name, op, prescale_factor=1.0, postscale_factor=1.0):
        self.last_allreduce = (op, prescale_factor, postscale_factor)
        return self._new(name, tensor)

    def broadcast_async_(self, tensor, root_rank, name):
        return self._new(name, tensor)

    def allgather_async(self, tensor, name):
        return self._new(name, tensor)

    def finish(self, name: str, error: BaseException | None = None) -> None:
        with self._lock:
            for op in self._ops.values():
                if op["name"] == name:
                    op["done"], op["error"] = True, error

    def poll(self, handle: int) -> bool:
        with self._lock:
            return self._ops[handle]["done"]

    def synchronize(self, handle: int):
        with self._lock:
            op = self._ops[handle]
        assert op["done"], "synchronize() on an incomplete handle would block for ever"
        self.synchronized.append(op["name"])
        if op["error"] is not None:
            raise op["error"]
        return op["output"]


@pytest.fixture
def fake(monkeypatch):
    hvd = FakeHorovod()
    monkeypatch.setattr(backends, "_import_horovod", lambda: hvd)
    made = []
    init = backends.HorovodBackend.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(backends.HorovodBackend, "__init__", tracked)
    yield hvd
    for backend in made:  # a failed test must not leave its (non-daemon) waiter holding the process open
        for name in [e[2] for e in backend._handles]:
            hvd.finish(name)
        backend.close()


def piece(name: str):
    return SimpleNamespace(name=name, view=torch.zeros(4))


class Outcomes:
    """What each piece's ``done`` got, and when."""

    def __init__(self) -> None:
        self.got: dict[str, list] = {}
        self.cv = threading.Condition()

    def done_for(self, name: str):
        def done(exc):
            with self.cv:
                self.got.setdefault(name, []).append((time.monotonic(), exc))
                self.cv.notify_all()
        return done

    def wait_for(self, names, timeout: float) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: all(n in self.got for n in names), timeout), self.got


def test_completions_are_reported_once_each_in_the_order_horovod_finishes_them(fake):
    backend = backends.HorovodBackend(TIMEOUT_S)
    out = Outcomes()
    for name in ("a", "b", "c"):
        backend.start(piece(name), out.done_for(name))
    for name in ("c", "a", "b"):  # not the issue order
        fake.finish(f"commsched.{name}")
        out.wait_for([name], 5.0)
    backend.close()
    assert {n: [e for _, e in got] for n, got in out.got.items()} == {"a": [None], "b": [None], "c": [None]}
    assert [out.got[n][0][0] for n in "cab"] == sorted(out.got[n][0][0] for n in "abc")
    assert fake.synchronized == ["commsched.c", "commsched.a", "commsched.b"]
    assert not backend._thread.is_alive()


def test_average_in_engine_asks_horovod_for_its_own_average_with_the_predivide_factor(fake):
    backend = backends.HorovodBackend(TIMEOUT_S)
    out = Outcomes()
    backend.start(piece("sum"), out.done_for("sum"))
    assert fake.last_allreduce == ("sum", 1.0, 1.0)  # a plain sum until the optimizer asks
    assert backend.average_in_engine(4.0) is True
    backend.start(piece("avg"), out.done_for("avg"))
    assert fake.last_allreduce == ("average", 0.25, 4.0)  # hvd.DistributedOptimizer's prescale 1/f, postscale f
    for name in ("sum", "avg"):
        fake.finish(f"commsched.{name}")
    out.wait_for(["sum", "avg"], 5.0)
    backend.close()


def test_a_handle_horovod_never_completes_fails_soon_after_horovod_failed_another(fake):
    backend = backends.HorovodBackend(timeout_s=30.0)  # the grace, not the timeout, bounds this one
    out = Outcomes()
    backend.start(piece("failed"), out.done_for("failed"))
    backend.start(piece("lost"), out.done_for("lost"))
    failed_at = time.monotonic()
    fake.finish("commsched.failed", RuntimeError("Horovod has been shut down"))
    out.wait_for(["failed", "lost"], backend.LOST_GRACE_S + 5.0)
    (_, first), = out.got["failed"]
    (lost_at, lost), = out.got["lost"]
    assert isinstance(first, RuntimeError)
    assert isinstance(lost, CommunicationError) and "never completed" in str(lost) and "commsched.lost" in str(lost)
    assert isinstance(lost.__cause__, RuntimeError)
    assert backend.LOST_GRACE_S <= lost_at - failed_at < backend.LOST_GRACE_S + 5.0
    started = time.monotonic()
    backend.close()
    assert time.monotonic() - started < 5.0 and not backend._thread.is_alive()
    assert "commsched.lost" not in fake.synchronized  # never waited on


def test_close_with_a_handle_in_flight_for_ever_returns_within_the_timeout_and_fails_it(fake):
    backend = backends.HorovodBackend(TIMEOUT_S)
    out = Outcomes()
    backend.start(piece("stuck"), out.done_for("stuck"))
    started = time.monotonic()
    backend.close()
    took = time.monotonic() - started
    assert TIMEOUT_S <= took <= TIMEOUT_S + 1.0 + 1.0
    assert not backend._thread.is_alive()
    (_, error), = out.got["stuck"]
    assert isinstance(error, CommunicationError) and "close()" in str(error)
    with pytest.raises(CommschedError, match="closed"):
        backend.start(piece("late"), out.done_for("late"))


def test_a_broadcast_no_peer_joins_raises_a_timeout_instead_of_waiting_for_ever(fake):
    backend = backends.HorovodBackend(TIMEOUT_S)
    try:
        started = time.monotonic()
        with pytest.raises(CommschedTimeout, match="broadcast commsched.broadcast_object.1"):
            backend.broadcast_object({"switch": 3}, 0)
        assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 2.0
        with pytest.raises(CommschedTimeout, match="broadcast commsched.broadcast.2"):
            backend.broadcast(torch.ones(3), 0)
    finally:
        backend.close()


def test_a_failed_object_gather_is_a_communication_error_naming_the_call(fake):
    backend = backends.HorovodBackend(TIMEOUT_S)
    threading.Timer(0.05, fake.finish, ("commsched.all_gather_object.1.sizes", RuntimeError("peer gone"))).start()
    try:
        with pytest.raises(CommunicationError, match="all-gather commsched.all_gather_object.1 failed.*peer gone"):
            backend.all_gather_object("mine")
    finally:
        backend.close()


def test_objects_travel_through_the_asynchronous_broadcast_and_gather(monkeypatch):
    class OneRank(FakeHorovod):  # world of one: every operation is done at once, outputs are the inputs
        def _new(self, name, output=None):
            handle = super()._new(name, output)
            self._ops[handle]["done"] = True
            return handle

    hvd = OneRank(size=1)
    monkeypatch.setattr(backends, "_import_horovod", lambda: hvd)
    backend = backends.HorovodBackend(TIMEOUT_S)
    try:
        assert backend.broadcast_object({"k": [1, 2.5, "x"]}, 0) == {"k": [1, 2.5, "x"]}
        assert backend.all_gather_object(("plan", 7)) == [("plan", 7)]
    finally:
        backend.close()
