"""The dispatch policies as pure objects (no threads, no clock), and the wire protocol.

The scheduler and the offline replay drive these same objects; here they are driven
by hand, so each rule is checked on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from commsched import OrderAgreementError, SchedulerConfig
from commsched.errors import CommschedError
from commsched.policy import (FifoPolicy, FollowerPolicy, ImmediatePolicy, LeaderPolicy, PriorityPolicy, Recorded,
                              StaticFollower, StaticLeader, Unstarted, agrees_on_order, edd_replay_order, fits,
                              make_policy)
from commsched.protocol import Abort, Close, Decision, EndOfStep, Lost, Plan, Ready, decode, encode


@dataclass(eq=False)
class T:
    name: str
    step: int = 0
    priority: int = 0
    seq: int = 0
    submitted_us: float = 0.0


@dataclass(eq=False)
class P:
    task: T
    index: int
    nbytes: int
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = f"{self.task.name}#{self.index}"

    @property
    def key(self):
        return (self.task.step, self.task.priority, self.task.seq, self.index)


def ready(policy, unstarted, *pieces):
    for p in pieces:
        unstarted.add(p)
        policy.add(p)


def drain(policy, unstarted, step=1, in_flight=0):
    out = []
    while (p := policy.next(unstarted, step, in_flight)) is not None:
        unstarted.started(p)
        out.append(p.name)
    return out


@pytest.mark.parametrize("world,ordering,negotiates,rank,expected", [
    (1, "dynamic", False, 0, PriorityPolicy), (1, "fifo", False, 0, PriorityPolicy),
    (2, "fifo", False, 0, FifoPolicy), (2, "fifo", True, 1, FifoPolicy),
    (2, "dynamic", True, 0, PriorityPolicy), (2, "static", True, 1, ImmediatePolicy),
    (2, "dynamic", False, 0, LeaderPolicy), (3, "dynamic", False, 2, FollowerPolicy),
    (2, "static", False, 0, StaticLeader), (2, "static", False, 1, StaticFollower),
])
def test_the_factory_is_the_one_place_that_maps_ordering_to_a_rule(world, ordering, negotiates, rank, expected):
    policy = make_policy(SchedulerConfig(ordering=ordering), rank, world, negotiates)
    assert type(policy) is expected
    assert agrees_on_order(SchedulerConfig(ordering=ordering), world, negotiates) == (
        policy.publishes or policy.reads_decisions)


def test_credit_admits_within_the_window_or_one_piece_alone_on_an_idle_link():
    assert fits(0, 100, 10) and fits(5, 5, 10) and not fits(6, 5, 10)


def test_priority_policy_starts_the_smallest_key_and_holds_the_head_of_the_line():
    u, policy = Unstarted(), PriorityPolicy(credit_bytes=8)
    late, urgent = T("late", priority=5, seq=0), T("urgent", priority=0, seq=1)
    ready(policy, u, P(late, 0, 4), P(late, 1, 4), P(urgent, 0, 8))
    assert policy.next(u, 0, in_flight=4) is None  # urgent (8 B) does not fit: nothing overtakes it
    assert drain(policy, u, in_flight=0)[:1] == ["urgent#0"]


def test_fifo_keeps_submission_order_and_immediate_ignores_credit():
    u, fifo = Unstarted(), FifoPolicy(credit_bytes=4)
    a, b = T("a", priority=9), T("b", priority=0)
    ready(fifo, u, P(a, 0, 4), P(b, 0, 4))
    assert fifo.next(u, 0, 4) is None
    assert drain(fifo, u) == ["a#0", "b#0"]
    u2, now = Unstarted(), ImmediatePolicy()
    ready(now, u2, P(a, 0, 100), P(b, 0, 100))
    assert now.next(u2, 0, 10**9).name == "a#0"


def test_leader_publishes_each_decision_and_ends_a_step_only_when_it_fully_started():
    u, leader = Unstarted(), LeaderPolicy(credit_bytes=100)
    w = T("w")
    ready(leader, u, P(w, 0, 4), P(w, 1, 4))
    first = leader.next(u, 1, 0)
    u.started(first)
    assert leader.issued(first) == [Decision(0, "w#0")]
    assert leader.steps_over(u, step=1) == []  # w#1 not started yet
    u.started(leader.next(u, 1, 4))
    assert leader.steps_over(u, step=1) == [EndOfStep(0)]


@pytest.mark.parametrize("ahead", [True, False])
def test_a_leader_deciding_ahead_publishes_an_ended_steps_order_at_once_and_keeps_it(ahead):
    u, leader = Unstarted(), LeaderPolicy(credit_bytes=8, ahead=ahead)
    a, b, c = T("a", priority=2, seq=0), T("b", priority=0, seq=1), T("c", priority=1, seq=2)
    late = T("late", priority=3, seq=3)
    ready(leader, u, P(a, 0, 4), P(a, 1, 4), P(b, 0, 4), P(c, 0, 4))
    u.wait_for(late)
    published = []
    for in_flight in (0, 4):  # the step is open: one decision per piece as it starts
        piece = leader.next(u, 0, in_flight)
        u.started(piece)
        published += leader.issued(piece)
    assert published == [Decision(0, "b#0"), Decision(0, "c#0")]
    assert leader.next(u, 0, 8) is None and leader.steps_over(u, step=0) == []
    assert leader.steps_over(u, step=1) == []  # ended, but late's gradient may still be more urgent
    u.arrived(late, None)
    ready(leader, u, P(late, 0, 4))
    ahead_msgs = leader.steps_over(u, step=1)
    assert ahead_msgs == ([Decision(0, "a#0"), Decision(0, "a#1"), Decision(0, "late#0")] if ahead else [])
    assert leader.steps_over(u, step=1) == []  # once
    d = T("d", step=1, priority=-5, seq=4)  # the next step's most urgent gradient never overtakes
    ready(leader, u, P(d, 0, 4))
    assert leader.next(u, 1, 8) is None  # the credit is spent: the head of the line waits
    order = []
    while (piece := leader.next(u, 1, 4)) is not None:
        u.started(piece)
        order.append(piece.name)
        published += leader.issued(piece)
    assert order == ["a#0", "a#1", "late#0", "d#0"]
    per_piece = [Decision(0, n) for n in ("a#0", "a#1", "late#0")]
    assert published[2:] == ([Decision(1, "d#0")] if ahead else per_piece + [Decision(1, "d#0")])
    assert leader.steps_over(u, step=1) == [EndOfStep(0)]
    assert leader.ahead_total == (3 if ahead else 0)


def test_make_policy_gives_rank0_of_dynamic_and_static_the_configs_decide_ahead():
    for ordering in ("dynamic", "static"):
        assert make_policy(SchedulerConfig(ordering=ordering), 0, 2, False).ahead is True
        assert make_policy(SchedulerConfig(ordering=ordering, decide_ahead=False), 0, 2, False).ahead is False


def test_with_ready_reports_the_leader_starts_what_is_ready_on_every_rank_first():
    """Balanced's trace: rank 0's backward ran ahead of rank 1's, so the more urgent layer rank 0 had
    just made was not ready on rank 1 yet; started first, it held the credit while the link idled."""
    u, leader = Unstarted(), LeaderPolicy(credit_bytes=8, followers=1)
    assert leader.reads_reports
    older, newer = T("l6", priority=6, seq=0), T("l5", priority=5, seq=1)
    ready(leader, u, P(older, 0, 4), P(older, 1, 4), P(older, 2, 4))
    leader.receive([Ready(0, 1, "l6")])  # rank 1 made l6
    ready(leader, u, P(newer, 0, 4), P(newer, 1, 4))  # rank 0 made l5 (more urgent); rank 1 has not yet
    assert drain(leader, u, step=0, in_flight=4) == ["l6#0", "l6#1", "l6#2"]  # not l5: it cannot move yet
    leader.receive([Ready(0, 1, "l5")])
    assert drain(leader, u, step=0, in_flight=4) == ["l5#0", "l5#1"]
    assert leader.held_total == 5 and leader.forced_total == 0  # l6 too, until its report came


def test_with_ready_reports_an_idle_link_starts_the_most_urgent_local_piece_and_reports_may_come_first():
    u, leader = Unstarted(), LeaderPolicy(credit_bytes=8, followers=2)
    a, b = T("a", priority=1, seq=0), T("b", priority=0, seq=1)
    leader.receive([Ready(0, 1, "b"), Ready(0, 2, "b")])  # a follower may be ahead of rank 0
    ready(leader, u, P(a, 0, 4), P(a, 1, 4))
    leader.receive([Ready(0, 1, "a")])  # one follower of two
    assert leader.next(u, 0, 4) is None  # something in flight: a waits for rank 2
    first = leader.next(u, 0, 0)  # nothing in flight and nothing ready everywhere: never wait on a report
    assert first.name == "a#0" and leader.forced_total == 1
    u.started(first)
    ready(leader, u, P(b, 0, 4))  # reported by both already: queued at once, ahead of a#1
    assert drain(leader, u, step=0, in_flight=4) == ["b#0"]
    assert leader.queued_keys() == [] and leader.held_keys() == [(0, 1, 0, 1)]  # a#1, still held
    leader.receive([Lost(ConnectionError("store gone"))])  # no more reports: decide on this rank alone
    assert not leader.reads_reports and leader.reports_lost is not None
    assert drain(leader, u, step=0, in_flight=4) == ["a#1"]


def test_with_ready_reports_a_step_is_decided_ahead_only_once_every_rank_has_it():
    u, leader = Unstarted(), LeaderPolicy(credit_bytes=4, ahead=True, followers=1)
    a, b = T("a", priority=1, seq=0), T("b", priority=0, seq=1)
    ready(leader, u, P(a, 0, 4), P(b, 0, 4))
    leader.receive([Ready(0, 1, "a")])
    assert leader.steps_over(u, step=1) == []  # b (more urgent) is not on rank 1: a is not fixed ahead of it
    leader.receive([Ready(0, 1, "b")])
    assert leader.steps_over(u, step=1) == [Decision(0, "b#0"), Decision(0, "a#0")]
    leader.step_ended(3, set())
    assert not leader._reports  # the reports of steps every rank ended are dropped


def test_make_policy_gives_dynamic_ready_reports_unless_the_config_turns_them_off():
    leader = make_policy(SchedulerConfig(ordering="dynamic"), 0, 3, False)
    follower = make_policy(SchedulerConfig(ordering="dynamic"), 2, 3, False)
    assert leader.followers == 2 and leader.reads_reports and follower.reports_ready
    off = SchedulerConfig(ordering="dynamic", ready_reports=False)
    assert not make_policy(off, 0, 3, False).reads_reports and not make_policy(off, 1, 3, False).reports_ready
    static = make_policy(SchedulerConfig(ordering="static"), 0, 2, False)  # static replays step 0's order
    assert not static.reads_reports and not make_policy(SchedulerConfig(ordering="static"), 1, 2, False).reports_ready


def test_follower_issues_rank0s_order_and_names_a_gradient_it_lacks():
    u, follower = Unstarted(), FollowerPolicy(credit_bytes=100, rank=1)
    a, b = T("a"), T("b")
    ready(follower, u, P(a, 0, 4), P(b, 0, 4))
    follower.receive([Decision(0, "b#0"), Decision(0, "a#0"), EndOfStep(0)])
    assert drain(follower, u, step=1) == ["b#0", "a#0"]
    follower.receive([Decision(1, "ghost#0")])
    with pytest.raises(OrderAgreementError, match="ghost"):
        follower.next(u, 2, 0)


def test_follower_waits_for_a_reserved_tensor_instead_of_calling_it_missing():
    u, follower = Unstarted(), FollowerPolicy(credit_bytes=100, rank=1)
    late = T("late")
    u.wait_for(late)
    follower.receive([Decision(0, "late#0"), EndOfStep(0)])
    assert follower.next(u, 1, 0) is None  # no error: its data is coming
    assert u.arrived(late, "data") == [(late, "data")]
    ready(follower, u, P(late, 0, 4))
    assert drain(follower, u) == ["late#0"]


def test_a_lost_store_is_an_error_only_while_pieces_wait_for_rank0():
    u, follower = Unstarted(), FollowerPolicy(credit_bytes=100, rank=1)
    follower.receive([Lost(ConnectionError("gone"))])
    assert follower.next(u, 0, 0) is None
    ready(follower, u, P(T("w"), 0, 4))
    with pytest.raises(Exception, match="lost contact"):
        follower.next(u, 0, 0)


def test_static_leader_makes_the_plan_from_step0_and_walks_it_without_messages():
    u, leader = Unstarted(), StaticLeader(credit_bytes=100)
    a0, b0 = T("a", priority=1, seq=0), T("b", priority=0, seq=1)
    ready(leader, u, P(a0, 0, 4), P(b0, 0, 4))
    order = []
    while (p := leader.next(u, 1, 0)) is not None:
        u.started(p)
        order.append(p.name)
        assert leader.issued(p) == [Decision(0, p.name)]
    assert order == ["b#0", "a#0"]
    assert leader.steps_over(u, 1) == [EndOfStep(0), Plan(("b#0", "a#0"))]
    a1, b1 = T("a", step=1, priority=1, seq=2), T("b", step=1, priority=0, seq=3)
    ready(leader, u, P(a1, 0, 4), P(b1, 0, 4))
    pieces = [leader.next(u, 2, 0) for _ in range(2)]
    assert [p.name for p in pieces] == ["b#0", "a#0"] and leader.issued(pieces[0]) == []
    with pytest.raises(OrderAgreementError, match="does not match the static plan"):
        leader.admit(2, "new", 1)
    with pytest.raises(OrderAgreementError, match=r"no gradient for \['a'\]"):
        leader.step_ended(2, {"b"})


def test_static_roles_with_a_later_record_step_follow_decisions_until_it_then_replay_its_order():
    """record_step=1: steps 0 and 1 as dynamic (the follower issues rank 0's decisions), step 1's
    order (not step 0's) is the plan, walked by both ranks from step 2 with no message."""
    (u0, leader), (u1, follower) = (Unstarted(), StaticLeader(100, record_step=1)), \
        (Unstarted(), StaticFollower(100, rank=1, record_step=1))

    def both(step, *names):  # the same gradients ready on both ranks, a urgent (priority 0)
        for u, policy in ((u0, leader), (u1, follower)):
            ready(policy, u, *(P(T(n, step=step, priority=n != "a", seq=2 * step + (n == "a")), 0, 4) for n in names))

    def run(step):  # rank 0 issues, its messages reach rank 1, which issues what it can
        issued, messages = [], []
        while (p := leader.next(u0, step, 0)) is not None:
            u0.started(p)
            issued.append(p.name)
            messages += leader.issued(p)
        messages += leader.steps_over(u0, step)
        follower.receive(messages)
        return issued, messages, drain(follower, u1, step=step)

    both(0, "b", "a")
    assert run(1) == (["a#0", "b#0"], [Decision(0, "a#0"), Decision(0, "b#0"), EndOfStep(0)], ["a#0", "b#0"])
    both(1, "b")  # step 1: b is ready before a, so it goes first
    first = run(1)
    both(1, "a")
    second = run(2)
    assert first[0] + second[0] == ["b#0", "a#0"] == first[2] + second[2]
    assert second[1][-2:] == [EndOfStep(1), Plan(("b#0", "a#0"))] and follower.done_reading
    for step in (2, 3):  # both ready at once: the replayed order is step 1's, not the priority order
        both(step, "a", "b")
        assert run(step + 1) == (["b#0", "a#0"], [], ["b#0", "a#0"])
        leader.step_ended(step, {"a", "b"})
    with pytest.raises(OrderAgreementError, match=r"no gradient for \['a'\]"):
        follower.step_ended(4, {"b"})
    with pytest.raises(ValueError, match="record_step=-1"):
        StaticLeader(100, record_step=-1)


def rec(name, layer, ready_ms, nbytes=4, index=0, algorithm="ring"):
    return Recorded(f"{name}#{index}", (0, layer, layer, index), ready_ms * 1000.0, nbytes, algorithm)


def test_the_edd_replay_order_keeps_the_link_busy_where_the_recorded_order_would_idle_it():
    """Backward makes layer 2, then 1, then 0 (the most urgent) ready. Rank 0's slow recorded step
    issued layer 0 before layer 1 (both were queued when the link freed); on the link as probed
    (5 ms a piece) layer 1 goes as soon as it is ready, and layer 0 cuts in when it is."""
    recorded = [rec("l2", 2, 0, index=0), rec("l2", 2, 0, index=1), rec("l0", 0, 12, index=0),
                rec("l0", 0, 12, index=1), rec("l1", 1, 9, index=0), rec("l1", 1, 9, index=1)]
    five_ms = lambda nbytes, algorithm: 0.005  # noqa: E731
    # one piece at a time: l2#0 [0,5], l2#1 [5,10], l1#0 ready at 9 [10,15], l0 ready at 12 goes next
    assert edd_replay_order(recorded, 4, five_ms) == ["l2#0", "l2#1", "l1#0", "l0#0", "l0#1", "l1#1"]
    # a link so slow that everything is queued before the second piece: pure priority order
    assert edd_replay_order(recorded, 4, lambda n, a: 1.0) == ["l2#0", "l0#0", "l0#1", "l1#0", "l1#1", "l2#1"]
    # credit for two pieces: both of l2 start at 0 (served one after another: done at 5 and 10)
    assert edd_replay_order(recorded, 8, five_ms)[:3] == ["l2#0", "l2#1", "l1#0"]
    # the duration is asked per piece, with its bytes and algorithm
    asked = []
    edd_replay_order([rec("h", 0, 0, 64, algorithm="hierarchical")], 4, lambda n, a: asked.append((n, a)) or 0.0)
    assert asked == [(64, "hierarchical")] and edd_replay_order([], 4, five_ms) == []


def test_a_static_leader_with_a_reorder_publishes_the_reordered_recorded_step_and_checks_it():
    seen = []

    def backwards(recorded):
        seen.extend(recorded)
        return [r.name for r in reversed(recorded)]

    def step0(leader):
        u = Unstarted()
        ready(leader, u, P(T("a", priority=0, submitted_us=7.0), 0, 4), P(T("b", priority=1, seq=1), 0, 3))
        while (p := leader.next(u, 1, 0)) is not None:
            u.started(p)
            leader.issued(p)
        return u

    leader = StaticLeader(credit_bytes=100, reorder=backwards)
    u = step0(leader)
    assert leader.steps_over(u, 1) == [EndOfStep(0), Plan(("b#0", "a#0"))]  # issued a, b; replays b, a
    assert [(r.name, r.ready_us, r.nbytes) for r in seen] == [("a#0", 7.0, 4), ("b#0", 0.0, 3)]
    bad = StaticLeader(credit_bytes=100, reorder=lambda recorded: ["a#0"])
    u = step0(bad)
    with pytest.raises(CommschedError, match="not a permutation of its 2 pieces"):
        bad.steps_over(u, 1)


def test_static_follower_refuses_a_queued_tensor_the_plan_has_no_place_for():
    u, follower = Unstarted(), StaticFollower(credit_bytes=100, rank=1)
    ready(follower, u, P(T("a"), 0, 4), P(T("extra", step=1), 0, 4))
    follower.receive([Decision(0, "a#0"), EndOfStep(0), Plan(("a#0",))])
    with pytest.raises(OrderAgreementError, match="'extra'"):
        drain(follower, u, step=2)


@pytest.mark.parametrize("batch", [
    [Decision(3, "layer.weight#0"), EndOfStep(3)], [Plan(("a#0", "b#1"))], [Plan(())],
    [Abort("rank 2: boom\nwith a second line")], [Close()],
    [Ready(4, 1, "layer.weight"), Ready(4, 2, "fused/0.bias+1.bias")],
])
def test_messages_survive_encode_and_decode(batch):
    assert decode(encode(batch)) == batch


def test_an_unknown_message_is_refused_with_its_text():
    with pytest.raises(ValueError, match="unknown order-agreement message 'X"):
        decode(b"X\t1")
