"""Failures reach every rank as a clear CommschedError, within the timeout, and nothing hangs."""

from __future__ import annotations

import array
import threading
import re
import time

import pytest

from commsched import (
    CommschedError,
    CommschedTimeout,
    CommunicationError,
    OrderAgreementError,
    RemoteAbort,
    Scheduler,
    SchedulerConfig,
)
from commsched.backends import ArrayOps, InProcessWorld

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]

CFG = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10)


def doubles(n: int, value: float = 1.0) -> array.array:
    return array.array("d", [value] * n)


def submit_step(s: Scheduler, names_sizes, futures=None):
    futures = [] if futures is None else futures
    for priority, (name, numel) in enumerate(names_sizes):
        futures.append(s.submit(name, doubles(numel), priority=priority))
    s.mark_step()
    return futures


def expect_failure(s: Scheduler, futures, timeout: float = 10.0) -> BaseException:
    """Synchronize, which must raise a CommschedError; then every future must be resolved."""
    t0 = time.monotonic()
    with pytest.raises(CommschedError) as exc_info:
        s.synchronize(timeout=timeout)
    assert time.monotonic() - t0 < timeout
    for f in futures:
        f.exception(timeout=5)  # resolved one way or the other (raises TimeoutError if it hangs)
    return exc_info.value


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_failing_piece_gives_every_rank_a_commsched_error_naming_the_tensor(ranks, world_size):
    def body(rank, s):
        futures = submit_step(s, [("a", 2), ("b", 6), ("c", 2)])
        error = expect_failure(s, futures)
        with pytest.raises(CommschedError):  # and it surfaces again at the next call
            s.submit("d", doubles(1))
        return error

    run = ranks(world_size, body, config=CFG, fail_pieces={"b#1"})
    run.raise_first()
    errors = run.results
    for rank, error in enumerate(errors):
        assert isinstance(error, (CommunicationError, RemoteAbort)), (rank, error)
        assert "'b'" in str(error), (rank, error)
    direct = [e for e in errors if isinstance(e, CommunicationError)]
    assert direct, "at least the first rank to see the failure reports it as a CommunicationError"
    assert all(e.tensor == "b" and e.piece == 1 for e in direct)
    assert "injected failure" in str(direct[0].__cause__)


@pytest.mark.parametrize("ordering", ["dynamic", "static", "fifo"])
def test_a_dead_rank_gives_every_rank_a_commsched_error_within_the_timeout(ranks, ordering):
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10, ordering=ordering)

    def body(rank, s):
        futures = []
        for _ in range(3):
            submit_step(s, [("a", 2), ("b", 4), ("c", 2)], futures)
        return expect_failure(s, futures)

    t0 = time.monotonic()
    run = ranks(3, body, config=cfg, kill_rank=2, kill_after=3)
    run.raise_first()
    assert time.monotonic() - t0 < cfg.timeout_s  # no wait may exceed timeout_s, so neither may failing
    # the rank that sees the death (rank 2 itself, or a peer of its closed connection; both when
    # they race) reports it; every other rank stops with one of those very reports
    direct = [e for e in run.results if isinstance(e, CommunicationError)]
    assert direct, run.results
    for error in direct:
        assert re.fullmatch(r"reducing tensor '\w' \(piece \d, elements \d:\d\) failed on rank \d: rank 2 (was "
                            r"killed by fault injection|closed the connection \(it died\) during operation \d+)",
                            str(error)), error
    for error in run.results:
        if not isinstance(error, CommunicationError):
            assert isinstance(error, RemoteAbort) and any(str(error).endswith(str(d)) for d in direct), error
    assert run.world.mismatches == []


def test_synchronize_raises_commsched_timeout_listing_pending_pieces_when_a_rank_never_submits():
    world = InProcessWorld(2)
    leader = Scheduler(world.backend(0), ArrayOps(), CFG, store=world.store)
    silent = Scheduler(world.backend(1), ArrayOps(), CFG, store=world.store)  # never submits
    try:
        future = leader.submit("w", doubles(4))
        leader.mark_step()
        t0 = time.monotonic()
        with pytest.raises(CommschedTimeout) as exc_info:
            leader.synchronize(timeout=0.3)
        # the call's own 0.3 s, not the scheduler's timeout_s (10 s), bounds this wait
        assert 0.3 <= time.monotonic() - t0 < CFG.timeout_s
        pending = exc_info.value.pending
        assert any(p.startswith("w#0") for p in pending), pending
        assert any(p.startswith("w#1") for p in pending), pending
        assert "w#0" in str(exc_info.value) and "0.3 s" in str(exc_info.value)
        with pytest.raises(CommschedTimeout):
            leader.wait(future, timeout=0.2)
        assert leader.pending() == pending  # a timeout is not a failure: the scheduler still works
        with pytest.raises(CommschedTimeout):  # close drains for at most its timeout, then reports
            leader.close(timeout=0.2)
        with pytest.raises(CommschedError, match="closed"):
            future.result(timeout=0)
    finally:
        silent.close()
        leader.close()
        world.close()


@pytest.mark.parametrize("odd_rank", [0, 2])
def test_a_tensor_submitted_on_one_rank_only_fails_every_rank_naming_it(ranks, odd_rank):
    """Every rank fails, at the latest in its next step's waits (rank 0 may finish the step
    before a follower notices, since the tensors they share were reduced correctly)."""
    def body(rank, s):
        futures = []
        try:
            for _ in range(2):
                futures += [s.submit("a", doubles(2)), s.submit("b", doubles(2))]
                if rank == odd_rank:
                    futures.append(s.submit("only_here", doubles(2), priority=-1))
                s.mark_step()
                s.synchronize(timeout=5)
        except CommschedError as exc:
            for f in futures:
                f.exception(timeout=5)
            return exc
        return None

    run = ranks(3, body, config=CFG)
    run.raise_first()
    for rank, error in enumerate(run.results):
        assert isinstance(error, (OrderAgreementError, RemoteAbort)), (rank, error)
        assert "only_here" in str(error), (rank, error)
    assert any(isinstance(e, OrderAgreementError) for e in run.results)
    assert run.world.mismatches == []  # caught by the scheduler, before the engine summed wrong data


def test_static_ordering_fails_every_rank_when_a_planned_tensor_is_missing_in_a_later_step(ranks):
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10, ordering="static")

    def body(rank, s):
        futures = submit_step(s, [("a", 2), ("b", 2)])
        try:  # rank 0 may fail its step 1 while this rank still finishes step 0: a RemoteAbort here
            s.synchronize(timeout=5)
            submit_step(s, [("a", 2)], futures)  # b is missing: an unused parameter, say
        except (OrderAgreementError, RemoteAbort) as exc:  # mark_step may see it at once
            return exc
        return expect_failure(s, futures)

    run = ranks(2, body, config=cfg)
    run.raise_first()
    for rank, error in enumerate(run.results):
        assert isinstance(error, (OrderAgreementError, RemoteAbort)), (rank, error)
        assert "'b'" in str(error), (rank, error)


def test_static_ordering_fails_every_rank_when_a_new_tensor_appears_in_a_later_step(ranks):
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10, ordering="static")

    def body(rank, s):
        futures = submit_step(s, [("a", 2)])
        try:  # as above: another rank's failure may reach this one while it finishes step 0
            s.synchronize(timeout=5)
            submit_step(s, [("a", 2), ("new", 2)], futures)
        except (OrderAgreementError, RemoteAbort) as exc:
            return exc
        return expect_failure(s, futures)

    run = ranks(2, body, config=cfg)
    run.raise_first()
    for rank, error in enumerate(run.results):
        assert isinstance(error, (OrderAgreementError, RemoteAbort)), (rank, error)
        assert "'new'" in str(error), (rank, error)


def test_static_ordering_fails_instead_of_hanging_when_a_tensor_grows_in_a_later_step(ranks):
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=64, timeout_s=10, ordering="static")

    def body(rank, s):
        futures = submit_step(s, [("a", 4)])  # 2 pieces in the plan
        s.synchronize(timeout=5)
        try:
            submit_step(s, [("a", 8)], futures)  # now 4 pieces
        except OrderAgreementError as exc:
            return exc
        return expect_failure(s, futures, timeout=5)

    run = ranks(2, body, config=cfg)
    run.raise_first()
    for rank, error in enumerate(run.results):
        assert isinstance(error, (OrderAgreementError, RemoteAbort)), (rank, error)
        assert "'a'" in str(error), (rank, error)


def test_an_exception_in_on_done_fails_the_future_and_surfaces_at_the_next_call():
    world = InProcessWorld(1)

    def explode(task):
        raise ValueError("optimizer step failed")

    try:
        with pytest.raises(CommschedError):
            with Scheduler(world.backend(0), ArrayOps(), CFG) as s:
                future = s.submit("p", doubles(2), on_done=explode)
                with pytest.raises(CommschedError, match="'p'") as exc_info:
                    future.result(timeout=5)
                assert isinstance(exc_info.value.__cause__, ValueError)
                with pytest.raises(CommschedError, match="'p'"):
                    s.submit("q", doubles(2))
                with pytest.raises(CommschedError, match="'p'"):
                    s.synchronize()
                raise CommschedError("leaving the with block with an error still closes the scheduler")
        assert s._closed
    finally:
        world.close()


class RaisingBackend:
    """start() raises for one piece, as an engine that rejects an operation at once."""

    def __init__(self, inner, bad: str) -> None:
        self.inner, self.bad = inner, bad
        self.rank, self.world_size, self.negotiates_order = inner.rank, inner.world_size, False

    def close(self) -> None:
        self.inner.close()

    def start(self, piece, done) -> None:
        if piece.name == self.bad:
            raise RuntimeError("engine rejected the operation")
        self.inner.start(piece, done)


def test_an_engine_error_on_the_dispatch_thread_surfaces_at_the_next_user_call():
    world = InProcessWorld(1)
    s = Scheduler(RaisingBackend(world.backend(0), "bad#0"), ArrayOps(), CFG)
    try:
        good = doubles(2)
        assert s.wait(s.submit("good", good), timeout=5) is good
        bad = s.submit("bad", doubles(2))
        with pytest.raises(CommunicationError, match="'bad'") as exc_info:
            bad.result(timeout=5)
        assert exc_info.value.tensor == "bad"
        assert "rejected" in str(exc_info.value.__cause__)
        with pytest.raises(CommunicationError, match="'bad'"):
            s.mark_step()
    finally:
        s.close()
        world.close()


def test_misuse_raises_value_errors_that_say_how_to_fix_it():
    world = InProcessWorld(2)
    try:
        with pytest.raises(ValueError, match="store"):
            Scheduler(world.backend(0), ArrayOps(), CFG)  # dynamic with 2 ranks needs a store
        with Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(ordering="fifo")) as s:
            assert s.mode == "fifo"
    finally:
        world.close()
    world = InProcessWorld(1)
    try:
        with Scheduler(world.backend(0), ArrayOps(), CFG) as s:
            for bad in ("", "a\tb", "a\nb", 3):
                with pytest.raises(ValueError, match="name"):
                    s.submit(bad, doubles(1))
    finally:
        world.close()


def test_a_timeout_on_one_rank_does_not_leave_other_ranks_hanging_forever(ranks):
    """Rank 1 stops after step 0 (a crash the engine does not notice); rank 0 times out, reports it."""
    started = threading.Event()

    def body(rank, s):
        futures = submit_step(s, [("a", 2)])
        s.synchronize(timeout=5)
        if rank == 1:
            started.wait(5)
            return None
        submit_step(s, [("a", 2)], futures)
        started.set()
        with pytest.raises(CommschedTimeout) as exc_info:
            s.synchronize(timeout=0.5)
        return exc_info.value

    run = ranks(2, body, config=CFG, close_timeout_s=0.2)
    run.raise_first()
    assert isinstance(run.results[0], CommschedTimeout)
    assert any(p.startswith("a#0") for p in run.results[0].pending)


def test_a_follower_that_loses_the_store_fails_clearly_and_so_does_rank0(ranks):
    """The follower cannot read rank 0's decisions (its store connection broke): an error, not a hang."""
    from commsched.store import InMemoryStore

    class BrokenPopStore(InMemoryStore):
        def pop(self, queue, timeout_s):
            raise ConnectionError("store connection reset")

    def body(rank, s):
        futures = []
        try:  # the follower may learn it before its second submit (which then raises it) or after
            submit_step(s, [("a", 2), ("b", 2)], futures)
        except CommschedError as exc:
            for f in futures:
                f.exception(timeout=5)
            return exc
        return expect_failure(s, futures)

    run = ranks(2, body, config=CFG, store=BrokenPopStore())
    run.raise_first()
    assert isinstance(run.results[1], CommschedError)
    assert "lost contact with rank 0" in str(run.results[1])
    assert isinstance(run.results[1].__cause__, ConnectionError)
    assert isinstance(run.results[0], RemoteAbort) and "lost contact" in str(run.results[0])


def test_check_raises_a_background_failure_and_a_remote_abort_without_blocking():
    with InProcessWorld(2, fail_pieces={"x#0"}) as world:
        s0 = Scheduler(world.backend(0), ArrayOps(), CFG, store=world.store)
        s1 = Scheduler(world.backend(1), ArrayOps(), CFG, store=world.store)
        s0.check()  # healthy: nothing to raise
        futures = [s.submit("x", doubles(2)) for s in (s0, s1)]
        for f in futures:
            f.exception(timeout=5)
        t0 = time.monotonic()
        with pytest.raises(CommunicationError, match="'x'"):
            s0.check()
        assert time.monotonic() - t0 < CFG.timeout_s  # a blocking check would wait up to timeout_s
        for s in (s0, s1):
            try:
                s.close(timeout=2)
            except CommschedError:
                pass
    with InProcessWorld(2) as world:
        s0 = Scheduler(world.backend(0), ArrayOps(), CFG, store=world.store)
        world.store.set("commsched/abort", b"rank 1: it broke")
        with pytest.raises(RemoteAbort, match="it broke"):
            s0.check()
        s0.close(timeout=2)
