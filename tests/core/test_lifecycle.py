"""Lifecycle: threads joined by close(), closed schedulers refuse work, zero-size tensors,
the Chrome-trace timeline, and a store that does not grow over a long run."""

from __future__ import annotations

import array
import json
import os
import sys
import threading
import time

import pytest

from commsched import CommschedError, CommschedTimeout, Scheduler, SchedulerClosed, SchedulerConfig
from commsched import scheduler as scheduler_module
from commsched.backends import ArrayOps, InProcessWorld
from helpers import commsched_threads

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]


def doubles(n: int, value: float = 1.0) -> array.array:
    return array.array("d", [value] * n)


def one_step(rank, s):
    futures = [s.submit(name, doubles(5, rank + 1), priority=i) for i, name in enumerate("abc")]
    s.mark_step()
    s.synchronize(timeout=5)
    return futures


@pytest.mark.parametrize("ordering, world_size", [("dynamic", 1), ("dynamic", 3), ("static", 3), ("fifo", 2)])
def test_close_joins_every_thread_the_scheduler_started(ranks, ordering, world_size):
    before = commsched_threads()
    run = ranks(world_size, one_step, config=SchedulerConfig(partition_bytes=16, ordering=ordering, timeout_s=10))
    run.raise_first()
    assert commsched_threads() - before == set()


def test_close_after_a_failure_joins_every_thread_including_the_abort_publisher(ranks):
    before = commsched_threads()

    def body(rank, s):
        one_step(rank, s)

    run = ranks(3, body, config=SchedulerConfig(partition_bytes=16, timeout_s=10), fail_pieces={"b#1"})
    assert all(isinstance(e, CommschedError) for e in run.errors)
    assert commsched_threads() - before == set()


def test_an_engine_completing_a_piece_after_close_starts_no_thread():
    """A collective the engine finishes (or fails) after close() must not start new background work."""
    before = commsched_threads()
    world = InProcessWorld(2)
    cfg = SchedulerConfig(timeout_s=10)
    leader = Scheduler(world.backend(0), ArrayOps(), cfg, store=world.store)
    follower = Scheduler(world.backend(1), ArrayOps(), cfg, store=world.store)
    leader.submit("stuck", doubles(2))  # rank 1 never submits it: it stays in flight
    with pytest.raises(CommschedTimeout):
        leader.close(timeout=0.2)
    follower.close()
    world.close()  # fails the stuck collective: its done() reaches the closed scheduler
    assert commsched_threads() - before == set()
    assert not world.store.check("commsched/abort"), "a closed scheduler announced an abort from a new thread"


def test_a_closed_scheduler_refuses_new_work_and_close_is_idempotent():
    world = InProcessWorld(1)
    try:
        s = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(timeout_s=10))
        with s:
            one_step(0, s)
        with pytest.raises(SchedulerClosed, match="closed"):
            s.submit("late", doubles(1))
        with pytest.raises(SchedulerClosed):
            s.mark_step()
        s.close()  # a second close is harmless
        assert isinstance(SchedulerClosed("x"), CommschedError)
    finally:
        world.close()


def test_futures_still_pending_at_close_fail_with_scheduler_closed():
    world = InProcessWorld(2)
    cfg = SchedulerConfig(timeout_s=10)
    leader = Scheduler(world.backend(0), ArrayOps(), cfg, store=world.store)
    follower = Scheduler(world.backend(1), ArrayOps(), cfg, store=world.store)
    try:
        future = leader.submit("orphan", doubles(2))
        with pytest.raises(CommschedTimeout):
            leader.close(timeout=0.1)
        with pytest.raises(SchedulerClosed, match="'orphan'"):
            future.result(timeout=0)
    finally:
        follower.close()
        world.close()


class StuckBackend:
    """An engine that never completes anything (so only zero-size tensors can finish)."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.negotiates_order = 0, 1, False
        self.started: list = []
        self.entered = threading.Event()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def start(self, piece, done) -> None:
        self.started.append((piece, done))
        self.entered.set()


def test_zero_size_tensors_complete_at_once_and_run_their_callback():
    backend = StuckBackend()
    s = Scheduler(backend, ArrayOps(), SchedulerConfig(timeout_s=10))
    try:
        s.submit("big", doubles(4))  # never completes: the engine is stuck
        seen = []
        empty = array.array("f")
        future = s.submit("empty", empty, on_done=lambda task: seen.append(task.name))
        assert future.result(timeout=5) is empty
        assert seen == ["empty"]
        assert backend.entered.wait(5)
        assert [p.name for p, _ in backend.started] == ["big#0"]
        assert s.pending() == ["big#0 (in flight)"]
    finally:
        for _, done in backend.started:
            done(None)
        s.close()


def test_zero_size_tensors_complete_on_every_rank_without_any_collective(ranks):
    def body(rank, s):
        futures = [s.submit("e1", doubles(0)), s.submit("x", doubles(1, rank + 1.0)), s.submit("e2", doubles(0))]
        s.mark_step()
        s.synchronize(timeout=5)
        return [f.result(timeout=0) for f in futures]

    run = ranks(3, body, config=SchedulerConfig(timeout_s=10))
    run.raise_first()
    assert run.world.issued == [["x#0"]] * 3
    assert all(list(r[1]) == [6.0] for r in run.results)


@pytest.mark.parametrize("pattern, names", [("trace.json", ["trace.rank0.json", "trace.rank1.json"]),
                                            ("trace-{rank}.json", ["trace-0.json", "trace-1.json"])])
def test_timeline_is_a_valid_chrome_trace_with_queued_and_comm_spans_and_step_markers(ranks, tmp_path, pattern, names):
    cfg = SchedulerConfig(partition_bytes=16, credit_bytes=32, timeout_s=10, timeline=str(tmp_path / pattern))

    def body(rank, s):
        for _ in range(2):
            one_step(rank, s)

    run = ranks(2, body, config=cfg)
    run.raise_first()
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    for rank, name in enumerate(names):
        trace = json.loads((tmp_path / name).read_text())
        events = trace["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        for e in spans:
            assert {"name", "cat", "ts", "dur", "pid", "tid"} <= set(e)
            assert e["pid"] == rank and e["dur"] >= 0 and isinstance(e["ts"], float)
        by_lane = {lane: sorted(e["name"] for e in spans if e["cat"] == lane) for lane in ("QUEUED", "COMM")}
        expected = sorted(f"{t}#{i}" for t in "abc" for i in range(3)) * 2
        assert by_lane["QUEUED"] == sorted(expected) and by_lane["COMM"] == sorted(expected)
        for e in spans:  # a piece is queued before it is in flight
            if e["cat"] == "COMM":
                assert e["args"]["bytes"] in (8, 16)
        markers = [e for e in events if e["ph"] == "i"]
        assert [m["name"] for m in markers] == ["step 0 end", "step 1 end"]
        meta = {e["name"] for e in events if e["ph"] == "M"}
        assert {"process_name", "thread_name"} <= meta


def test_no_timeline_file_is_written_unless_configured(ranks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COMMSCHED_TIMELINE", raising=False)
    run = ranks(2, one_step, config=SchedulerConfig(timeout_s=10))
    run.raise_first()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ordering", ["dynamic", "static"])
def test_the_store_does_not_grow_over_a_long_run(ranks, ordering):
    """Order decisions are removed from the store once read: 300 steps leave it as small as 10."""
    world_size = 3
    sizes: dict[int, int] = {}
    step_done = threading.Barrier(world_size, timeout=10)

    def body(rank, s):
        for step in range(300):
            for i, name in enumerate(("w", "b", "g")):
                s.submit(name, doubles(3, rank), priority=i)
            s.mark_step()
            s.synchronize(timeout=5)
            if step in (9, 299):
                step_done.wait()  # every rank finished the step: what is left in the store stays
                if rank == 0:
                    sizes[step] = len(run_world.store)
                step_done.wait()

    run_world = InProcessWorld(world_size)
    run = ranks(world_size, body, config=SchedulerConfig(partition_bytes=8, credit_bytes=16, ordering=ordering,
                                                         timeout_s=10), world=run_world)
    run.raise_first()
    assert sizes[299] <= sizes[9] + world_size, sizes  # at most a trailing END marker per follower
    assert sizes[299] <= 2 * world_size, sizes


def test_background_threads_are_named_and_not_daemons(ranks):
    seen = {}

    def body(rank, s):
        one_step(rank, s)
        seen[rank] = {t.name: t.daemon for t in commsched_threads() if t.name.endswith(f"-r{rank}")}

    run = ranks(2, body, config=SchedulerConfig(timeout_s=10))
    run.raise_first()
    assert set(seen[0]) >= {"commsched-dispatch-r0", "commsched-complete-r0", "commsched-publish-r0"}
    assert set(seen[1]) >= {"commsched-dispatch-r1", "commsched-complete-r1", "commsched-order-r1"}
    assert not any(daemon for per_rank in seen.values() for daemon in per_rank.values())


def test_close_at_exit_closes_the_newest_first_and_survives_a_failing_close():
    from commsched import lifecycle

    closed = []

    class Thing:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self, timeout):
            closed.append((self.name, timeout))
            if self.fail:
                raise RuntimeError("cannot")

    things = [Thing("scheduler"), Thing("wrapper", fail=True), Thing("outer")]
    for i, t in enumerate(things):
        lifecycle.close_at_exit(t, float(i))
    lifecycle._close_all()
    names = [n for n, _ in closed if n in ("scheduler", "wrapper", "outer")]
    assert names == ["outer", "wrapper", "scheduler"]
    assert ("scheduler", 0.0) in closed


def test_a_reduced_task_leaves_no_reference_cycle_behind():
    # Task -> its pieces -> each piece's task was a cycle: with the collector off (timeit turns it
    # off while it times) every step's tensors stayed alive and each step allocated fresh ones.
    import gc
    import weakref

    class Data(array.array):  # array.array takes no weak reference; a subclass does
        pass

    world = InProcessWorld(1)
    refs = []
    gc.collect()
    gc.disable()
    try:
        with Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(partition_bytes=16, timeout_s=10)) as s:
            for _step in range(3):
                for i in range(3):
                    data = Data("d", [1.0] * 5)  # 40 B: three pieces
                    refs.append(weakref.ref(data))
                    s.wait(s.submit(f"t{i}", data, priority=i), timeout=5)
                    del data
                s.mark_step()
            s.synchronize(timeout=5)
        alive = [r for r in refs[:-1] if r() is not None]  # (the scheduler may still name its last piece)
        assert alive == [], f"{len(alive)} of {len(refs) - 1} reduced tensors are only freed by the garbage collector"
    finally:
        gc.enable()
        world.close()  # its link thread is not a daemon: left running it holds the test process open


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_stats_split_the_threads_cpu_spent_in_the_engine_and_in_on_done(monkeypatch):
    """engine_cpu_s: the dispatch thread's CPU inside backend.start() (a piece too big to launch on
    the submitting thread), the completion thread's inside on_done and the engine thread's inside on_piece,
    each counted where it ran (every launch and completion timed here: CPU_SAMPLE_EVERY 1)."""
    monkeypatch.setattr(scheduler_module, "CPU_SAMPLE_EVERY", 1)
    world = InProcessWorld(1)
    try:
        backend = world.backend(0)
        real_start = backend.start

        def slow_start(piece, done):
            _burn(0.005)
            real_start(piece, done)

        backend.start = slow_start
        s = Scheduler(backend, ArrayOps(), SchedulerConfig(timeout_s=10, partition_bytes=64 << 20))
        with s:
            assert s.stats()["engine_cpu_s"] == {"launch": 0.0, "on_done": 0.0, "on_piece": 0.0}
            big = doubles((2 << 20) // 8)  # 2 MiB: over INLINE_MAX_BYTES, so the dispatch thread launches it
            s.wait(s.submit("big", big, on_done=lambda task: _burn(0.005),
                            on_piece=lambda piece: _burn(0.005)))
            s.mark_step()
            stats = s.stats()
            cpu = stats["engine_cpu_s"]
        assert cpu["launch"] >= 0.005 and cpu["on_done"] >= 0.005 and cpu["on_piece"] >= 0.005, cpu
        # the completion ran on the in-process engine's link thread, not one of commsched's: counted whole
        assert stats["callback_cpu_s"] >= cpu["on_piece"]
    finally:
        world.close()


def test_the_cpu_of_completions_is_sampled_and_scaled_to_an_estimate_of_the_whole():
    """A clock read per piece is a system call (a tenth of the scheduler's own cost per piece): one completion
    in CPU_SAMPLE_EVERY (8) is timed, at random, and scaled up. 400 pieces whose on_piece burns 0.4 ms each:
    the estimate is near their 160 ms (this seed times 37-43 of them: within half of it either way), never 0,
    never 8x."""
    assert scheduler_module.CPU_SAMPLE_EVERY == 8
    world = InProcessWorld(1)
    try:
        s = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(timeout_s=30, partition_bytes=8))
        with s:
            s.wait(s.submit("t", doubles(400), on_piece=lambda piece: _burn(0.0004)))
            s.mark_step()
            stats = s.stats()
        assert stats["pieces"] == 400
        assert 0.08 <= stats["engine_cpu_s"]["on_piece"] <= 0.24, stats["engine_cpu_s"]
        assert stats["callback_cpu_s"] >= stats["engine_cpu_s"]["on_piece"] * 0.99
    finally:
        world.close()


@pytest.mark.parametrize("ordering", ["fifo", "dynamic"])
def test_a_completion_wakes_the_dispatch_thread_only_when_a_piece_waits_to_start(ordering):
    """Small pieces start on the submitting thread; with nothing queued behind them, their
    completions must not wake the dispatch thread (a wake-up, two locks and an empty decision each:
    ~100 us of CPU a piece on the 2-core bench). With a credit that holds pieces back, every one
    still starts: the completions that free the credit do wake it."""
    world = InProcessWorld(1)
    try:
        s = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(timeout_s=10, ordering=ordering))
        with s:
            gen0 = s._work_gen
            for i in range(20):
                s.wait(s.submit(f"t{i}", doubles(1024)))
            assert s._work_gen - gen0 < 10, s._work_gen - gen0
            s.mark_step()
        held = Scheduler(world.backend(0), ArrayOps(),
                         SchedulerConfig(timeout_s=10, ordering=ordering, partition_bytes=8192, credit_bytes=8192))
        with held:
            futures = [held.submit(f"u{i}", doubles(4096)) for i in range(8)]  # 4 pieces each, one in flight
            for f in futures:
                held.wait(f, timeout=10)
            held.mark_step()
    finally:
        world.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is a per-thread attribute on Linux only")
@pytest.mark.parametrize("nice", [0, 5])
def test_every_thread_the_scheduler_starts_runs_thread_nice_below_its_creator(nice):
    """``thread_nice``: dispatch, complete, publish and order run that much lower in CPU priority than the
    thread that made the scheduler, which keeps its own (a raise of one's nice value needs no privilege)."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    world = InProcessWorld(2)
    cfg = SchedulerConfig(timeout_s=10, thread_nice=nice)
    schedulers = [Scheduler(world.backend(r), ArrayOps(), cfg, store=world.store) for r in range(2)]
    try:
        threads = [t for s in schedulers for t in s._threads]
        assert {t.name.split("-")[1] for t in threads} == {"dispatch", "complete", "publish", "order"}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(t.native_id is None for t in threads):
            time.sleep(0.01)
        assert {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threads} == {min(19, mine + nice)}
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        for s in schedulers:
            s.close(timeout=5)
        world.close()


def test_lower_priority_changes_nothing_at_zero_and_stops_at_nineteen():
    from commsched.lifecycle import lower_priority

    seen = {}

    def probe():
        seen["zero"] = lower_priority(0)
        seen["far"] = lower_priority(40)
        seen["now"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=probe)
    t.start()
    t.join(5)
    assert seen["zero"] is None
    if sys.platform.startswith("linux"):
        assert seen["far"] == seen["now"] == 19
