"""Deterministic ordering tests: priority, preemption, agreement, the static plan.

Ordering between threads is forced with Events and Barriers, and engine
completions are held back by :class:`HoldingBackend` where a test needs a piece to
stay in flight; nothing relies on sleeping.
"""

from __future__ import annotations

import array
import threading
import time

import pytest

from commsched import Scheduler, SchedulerConfig
from commsched import scheduler as scheduler_module
from commsched.backends import ArrayOps, InProcessWorld
from commsched.store import InMemoryStore

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]


class HoldingBackend:
    """Holds every completion back until :meth:`release`, so the scheduler sees its pieces in flight."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rank, self.world_size, self.negotiates_order = inner.rank, inner.world_size, False
        self._lock = threading.Lock()
        self._holding = True
        self._held: list = []

    def close(self) -> None:
        self.inner.close()

    def start(self, piece, done) -> None:
        def hold(exc):
            with self._lock:
                if self._holding:
                    self._held.append((done, exc))
                    return
            done(exc)
        self.inner.start(piece, hold)

    def release(self) -> None:
        with self._lock:
            self._holding = False
            held, self._held = self._held, []
        for done, exc in held:
            done(exc)


class CountingStore(InMemoryStore):
    """An in-memory store that counts writes (set and push)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def set(self, key, value):
        with self._cv:
            self.writes += 1
        super().set(key, value)

    def push(self, queue, value):
        with self._cv:
            self.writes += 1
        super().push(queue, value)


def holding_engine(negotiates: bool = False, **attrs):
    """A one-rank engine that records each start as (piece name, thread name) and keeps its ``done`` for
    the test to call: returns the engine, the starts, the held callbacks and the lock guarding both."""
    started: list[tuple[str, str]] = []
    held: list = []
    lock = threading.Lock()

    def start(_self, piece, done):
        with lock:
            started.append((piece.name, threading.current_thread().name))
            held.append(done)

    engine = type("Engine", (), {"rank": 0, "world_size": 1, "negotiates_order": negotiates, "start": start,
                                 **attrs})()
    return engine, started, held, lock


def doubles(n: int, value: float = 1.0) -> array.array:
    return array.array("d", [value] * n)


def test_ready_pieces_start_by_priority_with_ties_in_submission_order():
    world = InProcessWorld(1)
    held = HoldingBackend(world.backend(0))
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10)
    try:
        with Scheduler(held, ArrayOps(), cfg) as s:
            s.submit("blocker", doubles(4))  # two pieces, the whole credit, held in flight: the rest queues up
            submissions = [("a", 3, 5), ("b", 1, 2), ("c", 3, 1), ("d", 0, 4), ("e", 1, 3), ("f", -2, 1)]
            for name, priority, numel in submissions:
                s.submit(name, doubles(numel), priority=priority)
            assert world.issued[0] == ["blocker#0", "blocker#1"]  # started at once, on this thread
            held.release()
            s.mark_step()
            s.synchronize()
    finally:
        world.close()
    expected = ["blocker#0", "blocker#1"]
    for _, (name, _, numel) in sorted(enumerate(submissions), key=lambda e: (e[1][1], e[0])):
        expected += [f"{name}#{i}" for i in range((numel + 1) // 2)]
    assert world.issued[0] == expected


def test_the_next_step_never_overtakes_the_current_one_whatever_its_priority():
    world = InProcessWorld(1)
    held = HoldingBackend(world.backend(0))
    try:
        with Scheduler(held, ArrayOps(), SchedulerConfig(partition_bytes=8, credit_bytes=8, timeout_s=10)) as s:
            s.submit("blocker", doubles(1))  # the whole credit, held in flight
            s.submit("late_layer", doubles(2), priority=9)
            s.mark_step()
            s.submit("blocker", doubles(1), priority=0)
            s.submit("first_layer", doubles(1), priority=-5)
            held.release()
            s.mark_step()
            s.synchronize()
    finally:
        world.close()
    assert world.issued[0] == ["blocker#0", "late_layer#0", "late_layer#1", "first_layer#0", "blocker#0"]


def test_urgent_piece_submitted_later_overtakes_queued_pieces_at_a_piece_boundary():
    """Credit of one piece: while low#0 is in flight, an urgent tensor arrives and goes next on every rank."""
    world = InProcessWorld(2)
    held = HoldingBackend(world.backend(0))
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=16, timeout_s=10)
    first_issue = threading.Event()
    leader = Scheduler(held, ArrayOps(), cfg, store=world.store, observer=lambda *decision: first_issue.set())
    follower = Scheduler(world.backend(1), ArrayOps(), cfg, store=world.store)
    try:
        low0, low1 = doubles(8, 1.0), doubles(8, 2.0)
        urgent0, urgent1 = doubles(2, 10.0), doubles(2, 20.0)
        leader.submit("low", low0, priority=5)
        follower.submit("low", low1, priority=5)
        follower.submit("urgent", urgent1, priority=0)  # ready early on rank 1: rank 0 still decides
        assert first_issue.wait(5)
        assert leader.stats()["pieces"] == 1  # low#0 in flight, the credit is spent
        leader.submit("urgent", urgent0, priority=0)
        held.release()
        for s in (leader, follower):
            s.mark_step()
        for s in (leader, follower):
            s.synchronize()
    finally:
        leader.close()
        follower.close()
        world.close()
    assert world.issued[0] == ["low#0", "urgent#0", "low#1", "low#2", "low#3"]
    assert world.issued[1] == world.issued[0]
    assert world.mismatches == []
    assert list(low0) == list(low1) == [3.0] * 8
    assert list(urgent0) == list(urgent1) == [30.0] * 2
    assert max(world.max_in_flight_bytes) <= 16


def test_followers_issue_rank0s_order_even_when_their_readiness_is_reversed(ranks):
    names = [f"g{i}" for i in range(6)]

    def body(rank, s):
        order = names if rank == 0 else list(reversed(names))
        tensors = [doubles(3, rank + 1) for _ in names]
        for name, tensor in zip(order, tensors, strict=True):
            s.submit(name, tensor, priority=int(name[1:]))
        s.mark_step()
        s.synchronize()
        return tensors

    run = ranks(3, body, config=SchedulerConfig(partition_bytes=8, credit_bytes=16, timeout_s=10))
    run.raise_first()
    assert run.world.mismatches == []
    assert run.world.issued[1] == run.world.issued[2] == run.world.issued[0]
    assert all(list(t) == [6.0] * 3 for result in run.results for t in result)


@pytest.mark.parametrize("ahead", [True, False])
def test_rank0_publishes_the_rest_of_an_ended_step_in_one_batch_ahead_of_credit(ahead):
    """18 pieces, credit of 2. Deciding ahead, the 16 that wait when the step ends reach the followers
    in one push; piece by piece, every 2 pieces wait for a round trip through the store."""
    world, store = InProcessWorld(3), CountingStore()
    held = HoldingBackend(world.backend(0))
    cfg = SchedulerConfig(partition_bytes=8, credit_bytes=16, timeout_s=10, decide_ahead=ahead,
                          ready_reports=False)  # the followers' reports are pushes too (and timing: below)
    scheds = [Scheduler(held if r == 0 else world.backend(r), ArrayOps(), cfg, store=store) for r in range(3)]
    names = [f"g{i}" for i in range(6)]
    tensors = [[doubles(3, r + 1) for _ in names] for r in range(3)]
    try:
        for r in (2, 1, 0):
            for i, (name, t) in enumerate(zip(names, tensors[r], strict=True)):
                scheds[r].submit(name, t, priority=-i)  # the last submitted is the most urgent
            scheds[r].mark_step()
        deadline = time.monotonic() + 5
        while ahead and scheds[0].stats()["decided_ahead"] < 16 and time.monotonic() < deadline:
            time.sleep(0.01)
        held.release()
        for s in scheds:
            s.synchronize()
        stats = scheds[0].stats()
        writes = store.writes
    finally:
        for s in scheds:
            s.close()
        world.close()
    assert world.mismatches == [] and world.issued[1] == world.issued[2] == world.issued[0]
    assert world.issued[0][:2] == ["g0#0", "g0#1"]  # started at once, before the urgent ones arrived
    assert world.issued[0][2:] == [f"g{i}#{k}" for i in range(5, -1, -1) for k in range(3) if (i, k) not in
                                   ((0, 0), (0, 1))]
    assert all(list(t) == [6.0] * 3 for rank in tensors for t in rank)
    if ahead:  # the first decisions, the rest at once, the END: at most 4 pushes per follower
        assert stats["decided_ahead"] == 16 and writes <= 2 * 4, (stats, writes)
    else:
        assert stats["decided_ahead"] == 0 and writes > 2 * 8, (stats, writes)


@pytest.mark.parametrize("reports", [True, False])
def test_rank0_starts_a_piece_ready_on_every_rank_before_a_more_urgent_one_a_follower_lacks(reports):
    """Rank 0's backward ahead of rank 1's: ``new`` is more urgent but not on rank 1 yet. With the
    followers' ready reports rank 0 starts ``old#1`` (it can move) first; without, ``new#0``, which holds
    the credit until rank 1 makes it."""
    world, store = InProcessWorld(2), InMemoryStore()
    held = HoldingBackend(world.backend(0))
    cfg = SchedulerConfig(partition_bytes=8, credit_bytes=8, timeout_s=10, ready_reports=reports)
    scheds = [Scheduler(held if r == 0 else world.backend(r), ArrayOps(), cfg, store=store) for r in range(2)]
    old = [doubles(2, r + 1) for r in range(2)]
    new = [doubles(1, 10 * (r + 1)) for r in range(2)]
    try:
        scheds[1].submit("old", old[1], priority=5)
        policy = scheds[0]._state.policy
        deadline = time.monotonic() + 5
        while reports and policy._reports[(0, "old")] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)  # rank 1's report reached rank 0
        scheds[0].submit("old", old[0], priority=5)  # old#0 starts at once; old#1 waits for credit
        scheds[0].submit("new", new[0], priority=0)  # more urgent, on rank 0 only
        held.release()
        while len(world.issued[0]) < 2 and time.monotonic() < deadline + 5:
            time.sleep(0.005)  # rank 0 chose its second piece before rank 1 makes (and reports) new
        scheds[1].submit("new", new[1], priority=0)
        for s in scheds:
            s.mark_step()
            s.synchronize()
        stats = scheds[0].stats()
    finally:
        for s in scheds:
            s.close()
        world.close()
    assert world.mismatches == [] and world.issued[1] == world.issued[0]
    assert world.issued[0] == (["old#0", "old#1", "new#0"] if reports else ["old#0", "new#0", "old#1"])
    assert list(old[0]) == list(old[1]) == [3.0, 3.0] and list(new[0]) == list(new[1]) == [30.0]
    assert stats.get("held_for_reports", 0) == (1 if reports else 0)


def test_static_follower_starts_the_plan_that_arrives_after_it_submitted_everything():
    """Regression: a follower that read the plan with nothing else to do went back to sleep and hung."""
    world = InProcessWorld(2)
    cfg = SchedulerConfig(partition_bytes=64, credit_bytes=64, ordering="static", timeout_s=10)
    scheds = [Scheduler(world.backend(r), ArrayOps(), cfg, store=world.store) for r in range(2)]
    follower_ready = threading.Barrier(2, timeout=10)
    errors: list = []

    def rank0():
        s = scheds[0]
        s.wait(s.submit("a", doubles(4)))  # step 0 done on both ranks
        follower_ready.wait()  # rank 1 has ended step 0 and submitted step 1
        s.mark_step()  # now rank 0 publishes END(0) and the plan
        s.submit("a", doubles(4))
        s.mark_step()
        s.synchronize(timeout=5)

    def rank1():
        s = scheds[1]
        s.wait(s.submit("a", doubles(4)))
        s.mark_step()
        s.submit("a", doubles(4))
        s.mark_step()
        follower_ready.wait()
        s.synchronize(timeout=5)

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(f)) for f in (rank0, rank1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        for s in scheds:
            try:
                s.close(timeout=1)
            except Exception:
                pass
        world.close()
    assert errors == []
    assert world.issued == [["a#0", "a#0"], ["a#0", "a#0"]]


def test_static_ordering_with_only_zero_size_tensors_in_the_profiling_step_keeps_working(ranks):
    """Regression: an empty static plan made the dispatcher index an empty list and die."""
    def body(rank, s):
        futures = []
        for _ in range(3):
            futures.append(s.submit("empty", doubles(0)))
            assert s.mark_step() == len(futures)
        s.synchronize(timeout=5)
        return [f.result(timeout=0) for f in futures]

    run = ranks(2, body, config=SchedulerConfig(ordering="static", timeout_s=10))
    run.raise_first()
    assert run.world.issued == [[], []]


def test_static_ordering_repeats_rank0s_profiling_order_on_every_rank_in_later_steps(ranks):
    def body(rank, s):
        for step in range(4):
            names = ["x", "y", "z"] if (rank + step) % 2 else ["z", "y", "x"]
            for name in names:
                s.submit(name, doubles(3), priority={"x": 0, "y": 1, "z": 2}[name])
            s.mark_step()
        s.synchronize(timeout=5)

    run = ranks(3, body, config=SchedulerConfig(partition_bytes=8, credit_bytes=64, ordering="static",
                                                timeout_s=10))
    run.raise_first()
    issued = run.world.issued
    assert issued[1] == issued[2] == issued[0]
    plan = issued[0][:9]
    assert issued[0] == plan * 4
    assert run.world.mismatches == []


def test_static_ordering_sends_no_per_step_messages_once_the_plan_is_fixed(ranks):
    store = CountingStore()
    after_step1 = threading.Barrier(3, timeout=10)
    snapshot = {}

    def body(rank, s):
        for step in range(8):
            for name in ("a", "b", "c"):
                s.submit(name, doubles(2), priority=ord(name))
            s.mark_step()
            if step == 1:
                s.synchronize(timeout=5)
                after_step1.wait()
                if rank == 0:
                    snapshot["writes"] = store.writes
                after_step1.wait()
        s.synchronize(timeout=5)
        after_step1.wait()
        if rank == 0:
            snapshot["end"] = store.writes  # before close(), which may wake readers through the store
        after_step1.wait()

    world = InProcessWorld(3)
    run = ranks(3, body, config=SchedulerConfig(partition_bytes=8, credit_bytes=64, ordering="static",
                                                timeout_s=10), world=world, store=store)
    run.raise_first()
    assert snapshot["end"] == snapshot["writes"], "the leader kept writing to the store after the plan was fixed"


class NameMatchingWorld:
    """An engine that matches operations by name, as Horovod does: order need not agree."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._lock = threading.Lock()
        self._arrived: dict[str, dict[int, tuple]] = {}
        self.issued: list[list[str]] = [[] for _ in range(world_size)]
        self.in_flight = [0] * world_size
        self.max_in_flight = [0] * world_size

    def backend(self, rank: int):
        world = self
        return type("NameMatchingBackend", (), {
            "rank": rank, "world_size": self.world_size, "negotiates_order": True,
            "start": lambda _self, piece, done: world._start(rank, piece, done)})()

    def _start(self, rank, piece, done) -> None:
        with self._lock:
            self.issued[rank].append(piece.name)
            self.in_flight[rank] += piece.nbytes
            self.max_in_flight[rank] = max(self.max_in_flight[rank], self.in_flight[rank])
            arrived = self._arrived.setdefault(piece.name, {})
            arrived[rank] = (piece, done)
            if len(arrived) < self.world_size:
                return
            del self._arrived[piece.name]
            views = [p.view for p, _ in arrived.values()]
            for i in range(len(views[0])):
                total = sum(v[i] for v in views)
                for v in views:
                    v[i] = total
            for r, (p, _) in arrived.items():
                self.in_flight[r] -= p.nbytes
        for _, (_, d) in sorted(arrived.items()):
            d(None)


def test_with_an_engine_that_negotiates_order_only_rank0_paces_and_the_others_issue_at_once():
    world = NameMatchingWorld(2)
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10)
    scheds = [Scheduler(world.backend(r), ArrayOps(), cfg) for r in range(2)]  # no store needed
    assert [s.mode for s in scheds] == ["local", "immediate"]
    names = [f"layer{i}" for i in range(5)]
    tensors = [[doubles(4, r + 1.0) for _ in names] for r in range(2)]
    order = {0: list(range(5)), 1: list(reversed(range(5)))}
    barrier = threading.Barrier(2, timeout=10)
    errors: list = []

    def run(rank):
        try:
            barrier.wait()
            for i in order[rank]:
                scheds[rank].submit(names[i], tensors[rank][i], priority=i)
            scheds[rank].mark_step()
            scheds[rank].synchronize(timeout=5)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for s in scheds:
        s.close()
    assert errors == []
    assert all(list(t) == [3.0] * 4 for per_rank in tensors for t in per_rank)
    assert world.max_in_flight[0] <= 32  # rank 0 keeps the credit
    submitted_1 = [f"{names[i]}#{k}" for i in order[1] for k in range(2)]
    assert world.issued[1] == submitted_1  # rank 1 issues in its own ready order, without waiting
    assert sorted(world.issued[0]) == sorted(submitted_1)


@pytest.mark.parametrize("negotiates", [True, False], ids=["negotiating", "issue-ordered"])
def test_submit_starts_what_fits_on_its_own_thread(negotiates):
    # One thread hop less per piece: submit() starts what the credit allows at once, on the caller's
    # thread; what the credit holds back starts from the dispatch thread once a completion frees it.
    # On an engine that runs collectives in issue order (gloo, NCCL) both issue under one lock.
    backend, started, held, lock = holding_engine(negotiates)
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10)
    with Scheduler(backend, ArrayOps(), cfg) as sched:
        futures = [sched.submit(f"t{i}", doubles(2, 1.0), priority=i) for i in range(3)]  # 16 B each
        me = threading.current_thread().name
        assert started == [("t0#0", me), ("t1#0", me)]  # within the 32 B credit, at once, here
        with lock:
            first = held.pop(0)
        first(None)  # t0 lands: its credit lets t2 go, from the dispatch thread
        deadline = time.monotonic() + 5
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert started[2] == ("t2#0", "commsched-dispatch-r0")
        for done in list(held):
            done(None)
        sched.mark_step()
        for f in futures:
            sched.wait(f, timeout=5)


@pytest.mark.parametrize("negotiates", [True, False], ids=["negotiating", "issue-ordered"])
def test_pieces_too_big_to_launch_inline_go_from_the_dispatch_thread_in_the_decided_order(negotiates, monkeypatch):
    # The engine's launch of a large piece on the training thread delays backward, so submit()
    # hands pieces over INLINE_MAX_BYTES to the dispatch thread; what is decided while any is
    # still handed over, even small, follows it there, so the engine sees the decided order.
    monkeypatch.setattr(scheduler_module, "INLINE_MAX_BYTES", 16)
    started: list[tuple[str, str]] = []

    def start(_self, piece, done):
        started.append((piece.name, threading.current_thread().name))
        done(None)

    backend = type("Engine", (), {"rank": 0, "world_size": 1, "negotiates_order": negotiates, "start": start})()
    cfg = SchedulerConfig(partition_bytes=1 << 20, credit_bytes=1 << 20, timeout_s=10)
    names = []
    with Scheduler(backend, ArrayOps(), cfg) as sched:
        futures = []
        for i in range(60):  # big, small, big, small, ...: priorities rise, so decided = submitted
            name = f"t{i}"
            names.append(f"{name}#0")
            futures.append(sched.submit(name, doubles(4 if i % 2 == 0 else 1, 1.0), priority=i))
        sched.mark_step()
        for f in futures:
            sched.wait(f, timeout=5)
        sched.synchronize(timeout=5)
        later = sched.submit("later", doubles(1, 1.0))  # nothing handed over now: launched right here
        sched.wait(later, timeout=5)
    assert [name for name, _ in started] == names + ["later#0"]
    threads = dict(started)
    assert all(threads[f"t{i}#0"] == "commsched-dispatch-r0" for i in range(0, 60, 2))
    assert threads["later#0"] == threading.current_thread().name


def test_a_name_submitted_twice_in_a_step_before_it_started_is_rejected():
    world = InProcessWorld(1)
    held = HoldingBackend(world.backend(0))
    try:
        with Scheduler(held, ArrayOps(), SchedulerConfig(partition_bytes=8, credit_bytes=8, timeout_s=10)) as s:
            s.submit("blocker", doubles(1))  # the whole credit, held in flight: "w" waits unstarted
            first = s.submit("w", doubles(2))
            with pytest.raises(ValueError, match="'w'.*twice"):
                s.submit("w", doubles(2))
            held.release()
            s.mark_step()
            s.synchronize()
            assert first.done() and first.exception() is None
    finally:
        held.release()
        world.close()


@pytest.mark.parametrize("allowed", [True, False], ids=["start-on-done", "via-dispatch"])
def test_a_completion_starts_what_its_credit_freed_on_the_engines_thread_where_the_engine_allows(allowed,
                                                                                               monkeypatch):
    # SchedulerConfig.direct_start: an engine whose completion thread may start collectives
    # (Backend.starts_in_done: gloo's callbacks) gets the next piece started right there, one wake-up of
    # the dispatch thread less per piece; the CPU of that completion is counted (callback_cpu_s), since
    # the engine's thread is not one of commsched's (every completion timed here: CPU_SAMPLE_EVERY 1). Off
    # (or an engine without it): the dispatch thread.
    monkeypatch.setattr(scheduler_module, "CPU_SAMPLE_EVERY", 1)
    backend, started, held, lock = holding_engine(starts_in_done=True)
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10, direct_start=allowed)
    with Scheduler(backend, ArrayOps(), cfg) as sched:
        futures = [sched.submit(f"t{i}", doubles(2, 1.0), priority=i) for i in range(3)]  # 16 B each
        with lock:
            first = held.pop(0)
        engine = threading.Thread(target=first, args=(None,), name="engine-callback")
        engine.start()  # t0 lands on the engine's own thread: its credit lets t2 go
        engine.join(5)
        deadline = time.monotonic() + 5
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert started[2] == ("t2#0", "engine-callback" if allowed else "commsched-dispatch-r0")
        for done in list(held):
            done(None)
        sched.mark_step()
        for f in futures:
            sched.wait(f, timeout=5)
        stats = sched.stats()
    assert stats["started_direct"]["on_done"] == (1 if allowed else 0)
    assert stats["callback_cpu_s"] > 0  # the engine thread's completion, counted either way


def test_an_engine_that_completes_inside_start_neither_deadlocks_nor_recurses_with_direct_start():
    # A completion inside start() (an engine refusing a piece, or finishing at once) arrives while this
    # thread holds the issue lock: it must not wait for it (deadlock) nor start from within (recursion).
    started: list[str] = []
    depth = [0, 0]

    def start(_self, piece, done):
        depth[0] += 1
        depth[1] = max(depth[1], depth[0])
        started.append(piece.name)
        done(None)
        depth[0] -= 1

    backend = type("Engine", (), {"rank": 0, "world_size": 1, "negotiates_order": False, "start": start,
                                  "starts_in_done": True})()
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=16, timeout_s=10, direct_start=True)
    with Scheduler(backend, ArrayOps(), cfg) as sched:
        futures = [sched.submit(f"t{i}", doubles(4, 1.0), priority=i) for i in range(20)]  # 2 pieces each
        sched.mark_step()
        for f in futures:
            sched.wait(f, timeout=5)
    assert sorted(started) == sorted(f"t{i}#{k}" for i in range(20) for k in range(2))
    assert depth[1] == 1


def test_ranks_agree_on_the_order_when_completions_start_pieces_on_the_link_thread(ranks):
    # The in-process engine allows starts in its completions (its link thread, outside the world's
    # lock), as gloo does: with a credit of two pieces most pieces start there, and the k-th operation
    # of every rank must still be the same piece (the world records any mismatch), every sum right.
    n = 40

    def body(rank, sched):
        tensors = [doubles(8, float(rank + 1 + i)) for i in range(n)]
        futures = [sched.submit(f"g{i}", t, priority=n - i) for i, t in enumerate(tensors)]  # backward order
        sched.mark_step()
        for f in futures:
            sched.wait(f, timeout=10)
        return tensors, sched.stats()["started_direct"]["on_done"]

    cfg = SchedulerConfig(partition_bytes=32, credit_bytes=64, timeout_s=10, direct_start=True)
    run = ranks(2, body, config=cfg, bandwidth_bytes_per_s=2e6)
    run.raise_first()
    assert run.world.mismatches == []
    assert run.world.issued[0] == run.world.issued[1] and len(run.world.issued[0]) == 2 * n
    for tensors, _ in run.results:
        assert [t[0] for t in tensors] == [float(3 + 2 * i) for i in range(n)]
    assert all(on_done > 0 for _, on_done in run.results)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "via-dispatch"])
def test_a_follower_starts_pieces_on_its_order_thread_as_rank0s_decisions_arrive(ranks, direct):
    # direct_start: a follower whose gradients all wait for rank 0's decisions starts each decided piece on
    # the order thread that delivered the decision, not by waking its dispatch thread; rank 0's order is
    # kept either way.
    n = 12
    submitted = threading.Barrier(2, timeout=10)
    threads: list[str] = []

    def body(rank, sched):
        tensors = [doubles(4, float(rank + 1)) for _ in range(n)]
        if rank == 0:
            submitted.wait()  # the follower's gradients are all queued, undecided
        futures = [sched.submit(f"g{i}", t, priority=i) for i, t in enumerate(tensors)]
        sched.mark_step()
        if rank == 1:
            submitted.wait()
        for f in futures:
            sched.wait(f, timeout=10)
        return sched.stats()["started_direct"]

    cfg = SchedulerConfig(ordering="dynamic", partition_bytes=32, credit_bytes=64, timeout_s=10,
                          direct_start=direct)
    run = ranks(2, body, config=cfg, observers={1: lambda piece, queued, nbytes: threads.append(
        threading.current_thread().name)})
    run.raise_first()
    assert run.world.mismatches == [] and run.world.issued[0] == run.world.issued[1]
    assert len(threads) == n
    on_order = threads.count("commsched-order-r1")
    if direct:
        assert run.results[1]["on_delivery"] > 0 and on_order == run.results[1]["on_delivery"]
    else:
        assert run.results[1] == {"on_done": 0, "on_delivery": 0} and on_order == 0
