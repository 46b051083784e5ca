"""Tensors announced before their data is ready (``Scheduler.reserve``), ``abort`` and ``bounds``.

Engines like MXNet's write a gradient on an engine thread after the user's thread
asked for its reduction; the core keeps it pending, keeps order agreement waiting
for it, and (fifo) submits in the order the user's thread reserved.
"""

from __future__ import annotations

import array
import random
import threading

import pytest

from commsched import CommschedError, CommschedTimeout, SchedulerClosed, SchedulerConfig
from commsched.backends import ArrayOps, InProcessWorld
from commsched.partition import piece_bounds
from commsched.scheduler import Scheduler

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]

NAMES = [f"t{i}" for i in range(6)]


def _values(rank: int, i: int, n: int = 5) -> array.array:
    return array.array("d", [float(rank + 1) * (i + 1) + k for k in range(n)])


@pytest.mark.parametrize("ordering", ["fifo", "dynamic", "static"])
def test_tickets_ready_in_a_different_order_on_each_rank_reduce_correctly_in_one_agreed_order(ranks, ordering):
    # Each rank makes its data ready in its own random order, from other threads;
    # every rank must still issue the same sequence, and every sum must be right.
    config = SchedulerConfig(ordering=ordering, partition_bytes=16, credit_bytes=32)

    def body(rank: int, scheduler: Scheduler):
        rng = random.Random(rank * 7 + 1)
        results = []
        for _ in range(3):
            tickets = [scheduler.reserve(name, priority=len(NAMES) - i) for i, name in enumerate(NAMES)]
            tensors = [_values(rank, i) for i in range(len(NAMES))]
            order = list(range(len(NAMES)))
            rng.shuffle(order)
            makers = [threading.Thread(target=tickets[i].ready, args=(tensors[i],)) for i in order]
            for maker in makers:
                maker.start()
            for maker in makers:
                maker.join(10)
            scheduler.mark_step()
            results.append([list(scheduler.wait(t.future)) for t in tickets])
        return results

    run = ranks(2, body, config=config)
    run.raise_first()
    expected = [[float(a + b) for a, b in zip(_values(0, i), _values(1, i), strict=True)] for i in range(len(NAMES))]
    for rank_results in run.results:
        assert rank_results == [expected] * 3
    assert run.world.mismatches == []
    assert run.world.issued[0] == run.world.issued[1]
    assert len(run.world.issued[0]) == 3 * len(NAMES) * 3  # 5 doubles in 16-byte pieces: 3 pieces each
    if ordering == "fifo":  # reservation order, whatever order the data came in
        first_step = [name.split("#")[0] for name in run.world.issued[0][: len(NAMES) * 3]]
        assert first_step == [n for n in NAMES for _ in range(3)]


def test_a_reserved_tensor_is_pending_until_ready_and_synchronize_waits_for_it():
    world = InProcessWorld(1)
    scheduler = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(timeout_s=5))
    try:
        ticket = scheduler.reserve("w", priority=0)
        assert scheduler.pending() == ["w (waiting for data)"]
        with pytest.raises(CommschedTimeout) as info:
            scheduler.synchronize(timeout=0.3)
        assert "w (waiting for data)" in info.value.pending
        assert not ticket.future.done()
        data = array.array("d", [1.0, 2.0])
        ticket.ready(data)
        scheduler.synchronize(timeout=5)
        assert ticket.future.result(0) is data and scheduler.pending() == []
    finally:
        scheduler.close()
        world.close()


def test_close_fails_a_ticket_that_never_got_its_data_and_a_late_ready_is_ignored():
    world = InProcessWorld(1)
    scheduler = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(timeout_s=5))
    ticket = scheduler.reserve("w")
    with pytest.raises(CommschedTimeout):
        scheduler.close(timeout=0.2)
    assert isinstance(ticket.future.exception(0), SchedulerClosed)
    ticket.ready(array.array("d", [1.0]))  # an engine thread that comes too late: no error, nothing started
    assert world.issued == [[]]
    assert world.backend(0).closed is False  # the test's backend object; the scheduler closed its own
    world.close()


def test_a_ticket_with_data_the_ops_cannot_measure_fails_the_scheduler_instead_of_the_engine_thread():
    world = InProcessWorld(1)
    scheduler = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(timeout_s=5))
    try:
        ticket = scheduler.reserve("w")
        ticket.ready(object())  # ArrayOps cannot take its length: must not raise here
        with pytest.raises(CommschedError, match="'w' cannot be reduced"):
            scheduler.synchronize(timeout=5)
        assert isinstance(ticket.future.exception(5), CommschedError)
    finally:
        scheduler.close()
        world.close()


def test_reserving_a_name_twice_in_one_step_is_refused():
    world = InProcessWorld(1)
    scheduler = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(timeout_s=5))
    try:
        first = scheduler.reserve("w")
        with pytest.raises(ValueError, match="reserved twice"):
            scheduler.reserve("w")
        first.ready(array.array("d", [1.0]))
        scheduler.synchronize(5)
    finally:
        scheduler.close()
        world.close()


def test_abort_fails_every_pending_future_with_the_error_and_tells_the_other_rank(ranks):
    stuck = "the watchdog saw a gate closed for too long"
    seen = {}
    both_reserved = threading.Barrier(2, timeout=10)

    def body(rank: int, scheduler: Scheduler):
        ticket = scheduler.reserve("w")
        both_reserved.wait()
        if rank == 0:
            scheduler.abort(CommschedError(stuck))
            with pytest.raises(CommschedError, match="watchdog"):
                scheduler.synchronize(timeout=5)
            seen[rank] = ticket.future.exception(5)
        else:
            with pytest.raises(CommschedError, match="watchdog") as info:
                scheduler.synchronize(timeout=10)
            seen[rank] = info.value
        return type(seen[rank]).__name__

    run = ranks(2, body, config=SchedulerConfig(timeout_s=10))
    run.raise_first()
    assert run.results == ["CommschedError", "RemoteAbort"]


@pytest.mark.parametrize("numel,itemsize,partition", [(0, 4, 8), (10, 4, 8), (10, 8, 7), (1000, 2, 64)])
def test_bounds_are_the_pieces_submit_cuts_and_are_computed_once_per_size(numel, itemsize, partition):
    world = InProcessWorld(1)
    scheduler = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(partition_bytes=partition))
    try:
        bounds = scheduler.bounds(numel, itemsize)
        assert bounds == piece_bounds(numel, itemsize, partition)
        assert scheduler.bounds(numel, itemsize) is bounds
        if itemsize == 8:
            tensor = array.array("d", [1.0] * numel)
            future = scheduler.submit("x", tensor)
            scheduler.synchronize(5)
            assert future.result(0) is tensor
            assert scheduler.stats()["pieces"] == len(bounds)
    finally:
        scheduler.close()
        world.close()
