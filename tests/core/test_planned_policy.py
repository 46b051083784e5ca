"""``ordering="planned"``: the plan's piece order, walked on every rank from step 0 (PlannedPolicy),
per-group piece sizes and algorithms, and the start-up agreement on one plan (plan_agreement)."""

from __future__ import annotations

import array
import dataclasses
import re
import threading

import pytest

from commsched import OrderAgreementError, SchedulerConfig
from commsched.backends import InProcessWorld
from commsched.backends.inproc import ArrayOps
from commsched.costmodel.collectives import allreduce_s
from commsched.costmodel.topology import Topology
from commsched.errors import CommschedTimeout
from commsched.plan import OBSERVED_STEP, Plan, PlanGroup, PlanMismatch, PlannedPiece, PlannedTensor, fused_name
from commsched.plan_agreement import agree_on_plan, check_plan, store_gather
from commsched.policy import (FollowerPolicy, ImmediatePolicy, LeaderPolicy, PlanCutPriority, PlannedImmediate,
                              PlannedPolicy, PriorityPolicy, Recorded, StaticFollower, StaticLeader, Unstarted,
                              agrees_on_order, edd_replay_order, make_policy, replay_policy)
from commsched.protocol import Decision, EndOfStep
from commsched.protocol import Plan as PlanMessage
from commsched.scheduler import Scheduler
from commsched.store import InMemoryStore
from commsched.task import Piece, Task

pytestmark = [pytest.mark.timeout(30)]

SMALL = fused_name(["b", "c"])


def make_plan(order=None, credit=64, a_piece=16, nodes=1, ranks_per_node=1, algorithm="ring",
              issue="fixed") -> Plan:
    """a: 12 float32 (cut at ``a_piece`` bytes: 3 pieces of 4 at 16 B), b+c fused (2 + 3 elements, one piece)."""
    model = (PlannedTensor("a", 12, 4, (3, 4), "float32"), PlannedTensor("b", 2, 4, (2,), "float32"),
             PlannedTensor("c", 3, 4, (3,), "float32"))
    groups = (PlanGroup("a", ("a",), a_piece), PlanGroup(SMALL, ("b", "c"), 1024))
    order = order or [(SMALL, 0), ("a", 2), ("a", 0), ("a", 1)]
    pieces = tuple(PlannedPiece(t, i, algorithm) for t, i in order)
    return Plan(model=model, groups=groups, pieces=pieces, credit_bytes=credit, nodes=nodes,
                ranks_per_node=ranks_per_node, order=issue)


def task(name, step=0, priority=0, seq=0):
    return Task(name=name, tensor=None, priority=priority, step=step, seq=seq, future=None, on_done=None,
                submitted_us=0.0)


def pieces_of(policy, name, step, priority=0, seq=0, itemsize=4):
    t = task(name, step, priority, seq)
    out = []
    for i, (lo, hi) in enumerate(policy.bounds_for(name, policy.plan.group_numel(policy.plan.group(name)), itemsize)):
        out.append(Piece(t, i, lo, hi, (hi - lo) * itemsize, None, f"{name}#{i}",
                         algorithm=policy.algorithm_of(f"{name}#{i}")))
    return out


def drain(policy, step, in_flight=0, unstarted=None):
    unstarted = unstarted or Unstarted()
    out = []
    while (p := policy.next(unstarted, step, in_flight)) is not None:
        out.append(p.name)
    return out


def test_the_plan_order_is_walked_exactly_every_step_whatever_order_pieces_get_ready_in():
    policy = PlannedPolicy(make_plan(credit=1 << 20))
    for step in range(3):
        # a gets ready first, and its pieces in index order; the plan wants a#2 before a#0
        for p in pieces_of(policy, "a", step, priority=0):
            policy.add(p)
        assert drain(policy, step) == []  # the plan starts with the fused group, not ready yet
        for p in pieces_of(policy, SMALL, step, priority=1, seq=1):
            policy.add(p)
        assert drain(policy, step) == [f"{SMALL}#0", "a#2", "a#0", "a#1"]
    assert policy.position == (3, 0)


def test_a_later_steps_pieces_wait_until_the_plan_reaches_that_step():
    policy = PlannedPolicy(make_plan(credit=1 << 20))
    for p in pieces_of(policy, SMALL, 1) + pieces_of(policy, "a", 1):
        policy.add(p)  # step 1 is ready before step 0 (a simulator may drive it so)
    assert drain(policy, 0) == []
    for p in pieces_of(policy, SMALL, 0) + pieces_of(policy, "a", 0):
        policy.add(p)
    assert drain(policy, 1) == [f"{SMALL}#0", "a#2", "a#0", "a#1"] * 2


def test_credit_is_the_plans_and_a_piece_that_does_not_fit_waits_unless_the_link_is_idle():
    policy = PlannedPolicy(make_plan(credit=24))  # fused 20 B, a's pieces 16 B
    assert policy.credit_bytes == 24
    for p in pieces_of(policy, SMALL, 0) + pieces_of(policy, "a", 0):
        policy.add(p)
    assert policy.next(Unstarted(), 0, 0).name == f"{SMALL}#0"
    assert policy.next(Unstarted(), 0, 20) is None  # 20 + 16 > 24
    assert policy.next(Unstarted(), 0, 8).name == "a#2"  # 8 + 16 <= 24
    big = PlannedPolicy(make_plan(credit=4))
    for p in pieces_of(big, SMALL, 0):
        big.add(p)
    assert big.next(Unstarted(), 0, 0).name == f"{SMALL}#0"  # larger than the credit: alone
    assert PlannedPolicy(make_plan(credit=24), credit_bytes=100).credit_bytes == 100


def test_bounds_and_algorithms_come_from_the_plan_group_by_group():
    policy = PlannedPolicy(make_plan(a_piece=16, algorithm="hierarchical"))
    assert policy.bounds_for("a", 12, 4) == [(0, 4), (4, 8), (8, 12)]
    assert policy.bounds_for(SMALL, 5, 4) == [(0, 5)]  # the fused group is cut at its own 1024 B
    assert policy.algorithm_of("a#1") == "hierarchical"


def test_a_tensor_not_in_the_plan_or_of_another_size_is_refused_naming_it():
    policy = PlannedPolicy(make_plan())
    with pytest.raises(OrderAgreementError, match=r"tensor 'zzz' is not in the plan"):
        policy.bounds_for("zzz", 3, 4)
    with pytest.raises(OrderAgreementError, match=r"tensor 'zzz' is not in the plan"):
        policy.admit(0, "zzz", 1)
    with pytest.raises(OrderAgreementError, match=r"tensor 'a' has 13 elements of 4 B but the plan has 12"):
        policy.bounds_for("a", 13, 4)
    with pytest.raises(OrderAgreementError, match=r"'a' was cut into 2 pieces but the plan has 3"):
        policy.admit(0, "a", 2)


def test_a_step_without_a_planned_tensor_is_refused_naming_it():
    policy = PlannedPolicy(make_plan())
    with pytest.raises(OrderAgreementError, match=r"step 0 communicated no gradient for \['a'\]"):
        policy.step_ended(0, {SMALL})
    for p in pieces_of(policy, SMALL, 0):
        policy.add(p)
    assert drain(policy, 0) == [f"{SMALL}#0"]
    with pytest.raises(OrderAgreementError, match=r"no gradient for \['a'\]"):
        policy.next(Unstarted(), 1, 0)  # this rank moved on to step 1; the plan still waits for step 0's a


def test_make_policy_runs_the_plan_on_every_rank_and_needs_no_channel():
    plan = make_plan()
    config = SchedulerConfig(ordering="planned", plan=plan)
    for world, rank in ((1, 0), (2, 0), (2, 1), (4, 3)):
        policy = make_policy(config, rank, world, negotiates_order=False)
        assert isinstance(policy, PlannedPolicy) and not policy.publishes and not policy.reads_decisions
    assert isinstance(make_policy(config, 0, 2, negotiates_order=True), PlannedPolicy)
    follower = make_policy(config, 1, 2, negotiates_order=True)
    assert isinstance(follower, ImmediatePolicy)  # Horovod orders them: start when ready, no credit
    leader = make_policy(config, 0, 2, negotiates_order=True)
    for g in plan.groups:  # but the plan's cut, checks and algorithms, the same as rank 0's (Horovod matches by name)
        numel, size = plan.group_numel(g), plan.group_element_size(g)
        assert follower.bounds_for(g.name, numel, size) == leader.bounds_for(g.name, numel, size)
    for p in plan.pieces:
        assert follower.algorithm_of(p.name) == leader.algorithm_of(p.name)
    with pytest.raises(OrderAgreementError, match="not in the plan"):
        follower.bounds_for("other", 4, 4)
    with pytest.raises(OrderAgreementError, match="no gradient for"):
        follower.step_ended(0, set())
    assert not agrees_on_order(config, 4, False)
    assert isinstance(replay_policy("planned", None, plan), PlannedPolicy)
    with pytest.raises(ValueError, match="needs a plan"):
        make_policy(SchedulerConfig(ordering="planned"), 0, 2, negotiates_order=False)


# ------------------------------------------------------- a plan issued in the runtime's order
def test_a_priority_order_plan_keeps_its_cut_and_algorithms_but_goes_by_priority():
    plan = make_plan(credit=1 << 20, algorithm="hierarchical", issue="priority")
    policy = replay_policy("planned", None, plan)
    assert isinstance(policy, PlanCutPriority) and policy.credit_bytes == 1 << 20
    assert policy.bounds_for("a", 12, 4) == [(0, 4), (4, 8), (8, 12)] and policy.algorithm_of("a#1") == "hierarchical"
    for step in range(2):
        for p in pieces_of(policy, SMALL, step, priority=1, seq=0) + pieces_of(policy, "a", step, priority=0, seq=1):
            policy.add(p)
        # the listed order is SMALL#0, a#2, a#0, a#1; by priority, a (0) goes before SMALL (1), index order
        assert drain(policy, step) == ["a#0", "a#1", "a#2", f"{SMALL}#0"]
    with pytest.raises(OrderAgreementError, match=r"tensor 'zzz' is not in the plan"):
        policy.bounds_for("zzz", 3, 4)
    with pytest.raises(OrderAgreementError, match=r"step 0 communicated no gradient for \['a'\]"):
        policy.step_ended(0, {SMALL})
    with pytest.raises(OrderAgreementError, match=r"'a' was cut into 2 pieces but the plan has 3"):
        policy.admit(0, "a", 2)


def test_make_policy_gives_a_priority_order_plan_dynamics_leader_and_followers():
    config = SchedulerConfig(ordering="planned", plan=make_plan(credit=48, issue="priority"))
    leader, follower = (make_policy(config, r, 2, negotiates_order=False) for r in (0, 1))
    assert isinstance(leader.inner, LeaderPolicy) and leader.publishes and leader.mode == "leader"
    assert isinstance(follower.inner, FollowerPolicy) and follower.reads_decisions and follower.mode == "follower"
    assert leader.credit_bytes == follower.credit_bytes == 48  # the plan's credit, not the config's
    alone = make_policy(config, 0, 1, negotiates_order=False)
    assert isinstance(alone.inner, PriorityPolicy) and not alone.publishes
    hvd0, hvd1 = (make_policy(config, r, 2, negotiates_order=True) for r in (0, 1))
    assert isinstance(hvd0.inner, PriorityPolicy) and not hvd0.publishes  # Horovod matches by name
    assert isinstance(hvd1, PlannedImmediate)
    assert make_plan(issue="priority").digest != make_plan().digest  # ranks agree on the order rule too


def test_make_policy_gives_an_observed_order_plan_statics_leader_and_followers():
    plan = make_plan(credit=48, issue="observed")
    config = SchedulerConfig(ordering="planned", plan=plan)
    leader, follower = (make_policy(config, r, 2, negotiates_order=False) for r in (0, 1))
    assert isinstance(leader.inner, StaticLeader) and leader.publishes and leader.mode == "leader"
    assert isinstance(follower.inner, StaticFollower) and follower.reads_decisions
    assert leader.credit_bytes == follower.credit_bytes == 48
    assert isinstance(make_policy(config, 0, 1, negotiates_order=False).inner, PriorityPolicy)
    assert isinstance(make_policy(config, 0, 2, negotiates_order=True).inner, PriorityPolicy)  # Horovod
    assert isinstance(make_policy(config, 1, 2, negotiates_order=True), PlannedImmediate)
    assert leader.inner.record_step == follower.inner.record_step == OBSERVED_STEP
    assert leader.inner.reorder is None  # no topology in the plan: the recorded order as issued
    topo = Topology.emulated(2, None, "1gbit")
    linked = dataclasses.replace(plan, topology=topo.to_dict())
    with_link = make_policy(SchedulerConfig(ordering="planned", plan=linked), 0, 2, negotiates_order=False)
    # as issued in a slow step: a#0, then b (urgent, ready at 5 ms) cut in before a#1 (both of a ready
    # at 0, 32 B each: one at a time in the 48 B credit); on the probed link a is done before b is ready
    recorded = [Recorded("a#0", (0, 1, 0, 0), 0.0, 32, "ring"), Recorded("b#0", (0, 0, 1, 0), 5000.0, 32, "ring"),
                Recorded("a#1", (0, 1, 0, 1), 0.0, 32, "ring")]
    assert 2 * allreduce_s(topo, 32, "ring") < 0.005
    assert with_link.inner.reorder(recorded) == ["a#0", "a#1", "b#0"]
    assert edd_replay_order(recorded, 48, lambda n, a: 1.0) == ["a#0", "b#0", "a#1"]  # a slow link: as issued
    replayed = replay_policy("planned", None, plan)  # one deciding rank: step 0's order is its priority order
    assert isinstance(replayed, PlanCutPriority) and isinstance(replayed.inner, PriorityPolicy)
    assert len({plan.digest, make_plan(issue="priority").digest, make_plan().digest}) == 3


def test_an_observed_order_plan_issues_warm_steps_by_priority_then_replays_the_last_with_no_message():
    policy = make_policy(SchedulerConfig(ordering="planned", plan=make_plan(credit=1 << 20, algorithm="hierarchical",
                                                                              issue="observed")), 0, 2, False)
    assert policy.bounds_for("a", 12, 4) == [(0, 4), (4, 8), (8, 12)] and policy.algorithm_of("a#2") == "hierarchical"
    assert policy.inner.record_step == OBSERVED_STEP == 2
    u = Unstarted()

    def ready(step, name):  # a has priority 0, the fused group priority 1
        for p in pieces_of(policy, name, step, priority=0 if name == "a" else 1, seq=2 * step + (name == "a")):
            u.add(p)
            policy.add(p)

    def issue(step):
        out = []
        while (p := policy.next(u, step, 0)) is not None:
            u.started(p)
            out.append((p.name, policy.issued(p)))
        return out

    by_priority = ["a#0", "a#1", "a#2", f"{SMALL}#0"]
    for step in range(OBSERVED_STEP):  # warm steps: rank 0 decides by priority and publishes
        ready(step, SMALL)
        ready(step, "a")
        issued = issue(step + 1)
        assert [n for n, _ in issued] == by_priority  # by priority, not as the plan lists them
        assert [m for _, m in issued] == [[Decision(step, n)] for n in by_priority]
        assert policy.steps_over(u, step + 1) == [EndOfStep(step)]  # no plan yet
    # the recorded step: the fused group is ready first and goes first
    ready(OBSERVED_STEP, SMALL)
    recorded = issue(OBSERVED_STEP)
    ready(OBSERVED_STEP, "a")
    recorded += issue(OBSERVED_STEP + 1)
    order = [n for n, _ in recorded]
    assert order == [f"{SMALL}#0", "a#0", "a#1", "a#2"] and order != by_priority
    assert policy.steps_over(u, OBSERVED_STEP + 1) == [EndOfStep(OBSERVED_STEP), PlanMessage(tuple(order))]
    for step in (OBSERVED_STEP + 1, OBSERVED_STEP + 2):  # both ready at once: still the recorded order
        ready(step, "a")
        ready(step, SMALL)
        assert issue(step + 1) == [(n, []) for n in order]  # no message
        policy.step_ended(step, {"a", SMALL})
    with pytest.raises(OrderAgreementError, match=r"'a' was cut into 2 pieces but the plan has 3"):
        policy.admit(OBSERVED_STEP + 3, "a", 2)


def test_a_plan_without_an_order_field_is_fixed_and_an_unknown_order_is_refused(tmp_path):
    data = make_plan().to_dict()
    assert data["order"] == "fixed"
    del data["order"]  # a plan written before the field: same digest, fixed order
    assert Plan.from_dict(data).order == "fixed" and Plan.from_dict(data).digest == make_plan().digest
    path = tmp_path / "p.json"
    make_plan(issue="priority").to_json(str(path))
    assert Plan.from_json(str(path)).order == "priority"
    with pytest.raises(ValueError, match=r"order='random'; known: fixed, priority"):
        make_plan(issue="random")


def test_a_plan_must_order_each_piece_of_each_group_exactly_once():
    # a is cut into 3 pieces at 16 B: one left out, one past the cut, or one twice is refused, naming the group
    for order in ([(SMALL, 0), ("a", 0), ("a", 1)], [(SMALL, 0), ("a", 0), ("a", 1), ("a", 2), ("a", 3)]):
        with pytest.raises(ValueError, match=r"group 'a' has 3 pieces at 16 B but the plan orders .*exactly once"):
            make_plan(order=order)
    with pytest.raises(ValueError, match=r"piece 'a#1' is listed twice"):
        make_plan(order=[(SMALL, 0), ("a", 0), ("a", 1), ("a", 1), ("a", 2)])
    with pytest.raises(ValueError, match=re.escape(f"group {SMALL!r} has 1 pieces")):
        make_plan(order=[("a", 0), ("a", 1), ("a", 2)])
    with pytest.raises(ValueError, match=r"group 'a' has 1 pieces"):  # uncut at 48 B: a#0 alone
        make_plan(a_piece=48)
    assert make_plan(a_piece=48, order=[(SMALL, 0), ("a", 0)]).bounds("a") == [(0, 12)]


def test_ranks_of_an_inprocess_world_run_a_priority_order_plan_in_rank_zeros_order():
    plan = make_plan(credit=24, issue="priority")
    # rank 1's gradients get ready in another order than rank 0's: rank 0's order rules
    seen, tensors, stats, modes, mismatches = run_two_ranks(plan, a_first_on=(1,))
    for st in stats:
        assert st["plan_digest"] == plan.digest and st["credit_bytes"] == 24
        assert st["partition_bytes_per_group"] == {g.name: g.partition_bytes for g in plan.groups}
    assert modes == ["leader", "follower"]
    assert seen[0] == seen[1] and len(seen[0]) == 3 * len(plan.pieces)
    assert sorted(name for name, _ in seen[0][:4]) == sorted(plan.piece_names)  # the plan's pieces, any order
    assert mismatches == []
    assert list(tensors[(0, 2, "a")]) == [3.0] * 12 and list(tensors[(1, 0, "f")]) == [30.0] * 5


def test_ranks_of_an_inprocess_world_run_an_observed_order_plan_in_rank_zeros_step0_order():
    plan = make_plan(credit=24, issue="observed")
    seen, tensors, stats, modes, mismatches = run_two_ranks(plan, a_first_on=(1,))
    assert modes == ["leader", "follower"] and mismatches == []
    n = len(plan.pieces)
    assert seen[0] == seen[1] and len(seen[0]) == 3 * n
    assert seen[0][:n] == seen[0][n:2 * n] == seen[0][2 * n:]  # every step in step 0's order
    assert sorted(name for name, _ in seen[0][:n]) == sorted(plan.piece_names)
    assert list(tensors[(0, 2, "a")]) == [3.0] * 12 and list(tensors[(1, 0, "f")]) == [30.0] * 5


def test_a_plan_file_path_is_loaded(tmp_path):
    path = tmp_path / "plan.json"
    make_plan().to_json(str(path))
    policy = make_policy(SchedulerConfig(ordering="planned", plan=str(path)), 0, 2, negotiates_order=False)
    assert policy.plan.digest == make_plan().digest


def run_two_ranks(plan, a_first_on=(0, 1)):
    """Three steps of ``a`` and the fused group on 2 in-process ranks running ``plan``; ranks in
    ``a_first_on`` submit ``a`` first, the others the fused group first. Returns each rank's
    started ``(piece, algorithm)``, the tensors, each rank's stats and mode, and the mismatches."""
    seen: dict[int, list] = {0: [], 1: []}
    tensors: dict = {}
    with InProcessWorld(2) as world:
        scheds = [Scheduler(world.backend(r), ArrayOps(), SchedulerConfig(ordering="planned", plan=plan, timeout_s=10),
                            store=world.store, observer=lambda p, q, f, r=r: seen[r].append((p.name, p.algorithm)))
                  for r in range(2)]
        try:
            def run(r):
                for step in range(3):
                    a = tensors[(r, step, "a")] = array.array("f", [float(r + 1)] * 12)
                    fused = tensors[(r, step, "f")] = array.array("f", [float(10 * (r + 1))] * 5)
                    order = [("a", a, 0), (SMALL, fused, 1)]
                    futures = [scheds[r].submit(n, t, priority=p) for n, t, p in
                               (order if r in a_first_on else order[::-1])]
                    scheds[r].mark_step()
                    for f in futures:
                        scheds[r].wait(f)
            threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            for s in scheds:
                assert s.error is None, s.error
            stats, modes = [s.stats() for s in scheds], [s.mode for s in scheds]
        finally:
            for s in scheds:
                s.close()
    return seen, tensors, stats, modes, world.mismatches


def test_ranks_of_an_inprocess_world_issue_exactly_the_plan_with_its_piece_sizes_and_algorithms():
    plan = make_plan(credit=24, algorithm="hierarchical")
    seen, tensors, stats, modes, mismatches = run_two_ranks(plan)
    for st in stats:
        assert st["mode"] == "planned" and st["credit_bytes"] == 24
        assert st["plan_digest"] == plan.digest
        # the piece sizes in use are the plan's, not the config's 4 MiB default
        assert st["partition_bytes_per_group"] == {g.name: g.partition_bytes for g in plan.groups}
        assert st["partition_bytes"] == max(g.partition_bytes for g in plan.groups) != 4 << 20
        assert st["max_in_flight_bytes"] <= 24 or st["max_in_flight_bytes"] == 20
    want = [(name, "hierarchical") for name in plan.piece_names] * 3
    assert seen[0] == want and seen[1] == want
    assert mismatches == []
    assert list(tensors[(0, 2, "a")]) == [3.0] * 12 and list(tensors[(1, 0, "f")]) == [30.0] * 5


def test_a_scheduler_refuses_a_tensor_the_plan_does_not_know_and_fails_so_others_hear_of_it():
    with InProcessWorld(1) as world:
        sched = Scheduler(world.backend(0), ArrayOps(), SchedulerConfig(ordering="planned", plan=make_plan()))
        try:
            with pytest.raises(OrderAgreementError, match="'extra' is not in the plan"):
                sched.submit("extra", array.array("f", [1.0]))
            assert isinstance(sched.error, OrderAgreementError)
        finally:
            sched.close()


# ---------------------------------------------------------------- agreement at start
def agree_all(founds, timeout_s=5.0):
    store = InMemoryStore()
    results: dict[int, object] = {}

    def run(r):
        try:
            results[r] = agree_on_plan(founds[r], rank=r, world_size=len(founds),
                                       gather=store_gather(store, "t", r, len(founds), timeout_s))
        except BaseException as exc:
            results[r] = exc
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(founds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return [results[r] for r in range(len(founds))]


def test_ranks_with_the_same_plan_agree():
    plans = [make_plan(), make_plan()]  # equal, separately built (loaded from copies of one file)
    results = agree_all(plans)
    assert results[0] is plans[0] and results[1] is plans[1]


def test_a_rank_with_another_plan_makes_every_rank_raise_naming_the_difference():
    results = agree_all([make_plan(credit=64), make_plan(credit=128), make_plan(credit=64)])
    assert all(isinstance(r, PlanMismatch) for r in results), results
    assert all("rank 1's plan" in str(r) and "credit_bytes 128 vs rank 0's 64" in str(r) for r in results)
    reordered = agree_all([make_plan(), make_plan(order=[("a", 0), ("a", 1), ("a", 2), (SMALL, 0)])])
    assert all(isinstance(r, PlanMismatch) and "another piece order" in str(r) for r in reordered)


def test_a_rank_that_cannot_run_its_plan_makes_every_rank_raise():
    wrong = PlanMismatch("the plan was made for another model: changed: a: ...")
    results = agree_all([make_plan(), wrong])
    assert results[1] is wrong
    assert isinstance(results[0], PlanMismatch) and "rank 1 cannot run its plan" in str(results[0])
    assert "another model" in str(results[0])


def test_a_rank_that_never_posts_is_a_timeout_not_a_hang():
    store = InMemoryStore()
    with pytest.raises(CommschedTimeout, match="waiting for rank 1 to check its plan"):
        agree_on_plan(make_plan(), rank=0, world_size=2, gather=store_gather(store, "t", 0, 2, 0.3))


def test_check_plan_names_the_parameter_of_another_model_and_the_world():
    plan = make_plan()
    ok = [PlannedTensor("a", 12, 4, (3, 4), "float32"), PlannedTensor("b", 2, 4, (2,), "float32"),
          PlannedTensor("c", 3, 4, (3,), "float32")]
    assert check_plan(plan, ok, 1) is plan
    changed = [ok[0], PlannedTensor("b", 2, 4, (1, 2), "float32"), ok[2]]
    with pytest.raises(PlanMismatch, match=r"changed: b: plan 2 elements of 4 B shape \[2\]"):
        check_plan(plan, changed, 1)
    with pytest.raises(PlanMismatch, match="this run has 2"):
        check_plan(plan, ok, 2)
