"""The in-process engine the core's tests stand on: matching by issue order, sums, faults."""

from __future__ import annotations

import array
import threading
from types import SimpleNamespace

import pytest

from commsched import OrderAgreementError
from commsched.backends import InProcessWorld

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]


def piece(name: str, values) -> SimpleNamespace:
    tensor = array.array("d", values)
    return SimpleNamespace(name=name, nbytes=len(tensor) * tensor.itemsize, view=memoryview(tensor), tensor=tensor)


class Done:
    """A done() callback that records its calls and can block the link thread until released."""

    def __init__(self, block: threading.Event | None = None) -> None:
        self.calls: list = []
        self.called = threading.Event()
        self.block = block

    def __call__(self, exc) -> None:
        self.calls.append(exc)
        self.called.set()
        if self.block is not None:
            assert self.block.wait(10)


def test_the_kth_operations_of_all_ranks_are_summed_together():
    with InProcessWorld(3) as world:
        pieces = [piece("x#0", [r + 1.0, 10.0 * (r + 1)]) for r in range(3)]
        dones = [Done() for _ in range(3)]
        for r in range(3):
            world.backend(r).start(pieces[r], dones[r])
        for d in dones:
            assert d.called.wait(5)
    assert [d.calls for d in dones] == [[None]] * 3
    assert all(list(p.tensor) == [6.0, 60.0] for p in pieces)
    assert world.issued == [["x#0"]] * 3 and world.mismatches == []


def test_different_pieces_at_the_same_position_fail_both_ranks_and_are_recorded():
    with InProcessWorld(2) as world:
        dones = [Done(), Done()]
        world.backend(0).start(piece("a#0", [1.0]), dones[0])
        world.backend(1).start(piece("b#0", [1.0]), dones[1])
        for d in dones:
            assert d.called.wait(5)
    assert all(isinstance(d.calls[0], OrderAgreementError) for d in dones)
    assert len(world.mismatches) == 1 and "a#0" in world.mismatches[0] and "b#0" in world.mismatches[0]


def test_a_rank_dying_while_a_complete_operation_waits_for_the_link_completes_it_once():
    """Regression: a death re-queued operations that were already queued, and the link thread crashed
    on the duplicate (KeyError), leaving every later operation of the world hanging."""
    release = threading.Event()
    world = InProcessWorld(2, kill_rank=1, kill_after=2)
    try:
        first = [Done(block=release), Done()]
        second = [Done(), Done()]
        for r in range(2):
            world.backend(r).start(piece("a#0", [1.0]), first[r])
        assert first[0].called.wait(5)  # the link thread is now held inside op 0's callback
        for r in range(2):
            world.backend(r).start(piece("b#0", [1.0]), second[r])  # op 1: complete, queued for the link
        with pytest.raises(ConnectionError, match="killed"):
            world.backend(1).start(piece("c#0", [1.0]), Done())  # rank 1 dies here
        third = Done()
        world.backend(0).start(piece("c#0", [1.0]), third)  # op 2: waits for the dead rank, so it fails
        release.set()
        for d in second + [third]:
            assert d.called.wait(5)
        assert [len(d.calls) for d in second] == [1, 1]  # once each (it fails: a rank of it is dead by now)
        assert isinstance(third.calls[0], ConnectionError) and "died" in str(third.calls[0])
        assert world._link.is_alive()
    finally:
        release.set()
        world.close()


def test_closing_the_world_fails_operations_still_waiting_for_other_ranks():
    world = InProcessWorld(2)
    waiting = Done()
    world.backend(0).start(piece("lonely#0", [1.0]), waiting)
    world.close()
    assert len(waiting.calls) == 1 and isinstance(waiting.calls[0], ConnectionError)
