"""``ordering="planned"`` on the commsched KVStore (2 workers, 1 server): the plan's order and piece
sizes, bitwise equal to plain dist_sync; a plan for another model, a plan that differs on one
worker, a fused plan and the issue gate are refused on every worker, without a hang.

One launched job runs every scenario (see test_equivalence.py for the reference each is
compared with).
"""

from __future__ import annotations

import pytest

pytest.importorskip("mxnet")

SCENARIOS = {
    "planned": {"ordering": "planned", "plan": "good", "steps": 4},
    "planned_adam": {"ordering": "planned", "plan": "good", "optimizer": "adam", "steps": 3},
    "planned_priority": {"ordering": "planned", "plan": "priority", "steps": 4},
    "other_model": {"ordering": "planned", "plan": "other_model", "refused": True},
    "differs": {"ordering": "planned", "plan": "differs", "refused": True},
    "fused": {"ordering": "planned", "plan": "fused", "refused": True},
    "issue_gate": {"ordering": "planned", "plan": "good", "gate": "issue", "refused": True},
}
PIECES = 3 + 1 + 8 + 3 + 4 + 1  # the weights at 2048, 1024, 512 B, the biases at 1024, 64, 1024 B


@pytest.fixture(scope="module")
def results(tmp_path_factory, run_scenarios):
    return run_scenarios(tmp_path_factory.mktemp("planned"), SCENARIOS)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("name", ["planned", "planned_adam", "planned_priority"])
def test_planned_training_equals_plain_dist_sync_bitwise(results, name):
    for rank, r in results[name].items():
        assert r["bitwise"], f"rank {rank}, {name}: weights differ from plain dist_sync by {r['max_diff']}"


@pytest.mark.timeout(170)
@pytest.mark.parametrize("name", ["planned", "planned_adam"])
def test_every_step_starts_the_plans_pieces_in_its_order_within_its_credit(results, name):
    for rank, r in results[name].items():
        steps = r["scenario"]["steps"]
        assert r["pieces"] == steps * PIECES, r["pieces"]  # cut at each key's planned size
        assert r["order"], "no step recorded"
        for step, order in r["order"].items():  # (the stats keep the last steps)
            assert order == r["plan_order"], f"rank {rank} step {step}"
        assert r["max_in_flight_bytes"] <= r["credit"] == 4096


@pytest.mark.timeout(170)
def test_a_plan_of_priority_order_starts_its_pieces_in_rank_zeros_order_on_every_worker(results):
    by_rank = [r for _, r in sorted(results["planned_priority"].items())]
    assert len(by_rank) == 2 and by_rank[0]["order"], by_rank
    assert [r["mode"] for r in by_rank] == ["leader", "follower"]  # rank 0 decides by priority
    assert by_rank[0]["order"] == by_rank[1]["order"]  # the follower took rank 0's decisions
    for step, order in by_rank[0]["order"].items():
        assert sorted(order) == sorted(by_rank[0]["plan_order"]), f"step {step}: the plan's pieces, each once"


@pytest.mark.timeout(170)
@pytest.mark.parametrize("name, at, words", [
    ("other_model", "training", "made for another model"),
    ("differs", "construction", "differs from rank 0's"),
])
def test_a_wrong_or_differing_plan_is_a_plan_mismatch_on_every_worker(results, name, at, words):
    for rank, r in results[name].items():
        assert r["refused"], f"rank {rank} ran a {name} plan"
        assert r["is_plan_mismatch"], r["refused"]
        assert r["at"] == at, r
        assert r["seconds"] < 30, r  # before any piece, not after a timeout
    assert any(words in r["refused"] for r in results[name].values()), results[name]
    if name == "other_model":
        assert all("plan 1920 elements of 4 B shape [48, 40]" in r["refused"] and "plan_model" in r["refused"]
                   for r in results[name].values())


@pytest.mark.timeout(170)
@pytest.mark.parametrize("name, words", [("fused", "--fusions-mb 0"), ("issue_gate", "needs the engine gate")])
def test_what_the_kvstore_cannot_run_is_refused_at_construction_naming_the_fix(results, name, words):
    for r in results[name].values():
        assert r["at"] == "construction" and words in r["refused"], r


# ------------------------------------------------------------------ one process ('local' store)
def _local_plan(sizes=(("a", (6, 8), 64), ("b", (5,), 1024)), order=None, credit=96):
    from commsched.plan import Plan, PlanGroup, PlannedPiece, PlannedTensor

    model = tuple(PlannedTensor(n, s[0] * (s[1] if len(s) > 1 else 1), 4, s, "float32") for n, s, _ in sizes)
    groups = tuple(PlanGroup(n, (n,), b) for n, _, b in sizes)
    order = order or [("b", 0), ("a", 2), ("a", 0), ("a", 1)]
    return Plan(model=model, groups=groups, pieces=tuple(PlannedPiece(t, i) for t, i in order), credit_bytes=credit)


@pytest.mark.timeout(60)
def test_on_one_worker_keys_are_cut_at_the_plans_sizes_and_started_in_its_order():
    import mxnet as mx
    import numpy as np

    import commsched
    import commsched.plugins.mxnet as cmx

    plan = _local_plan()
    config = commsched.SchedulerConfig(ordering="planned", plan=plan, timeout_s=30)
    with cmx.KVStore("local", config) as kv:
        arrays = {"a": mx.nd.ones((6, 8)), "b": mx.nd.full((5,), 2.0)}
        for k, v in arrays.items():
            kv.init(k, v)
        assert [len(kv._entries[k].bounds) for k in "ab"] == [3, 1]  # a: 48 floats at 64 B
        for _ in range(2):
            for k in "ab":
                kv.pushpull(k, arrays[k])
        kv.synchronize()
        stats = kv.stats()
        assert all(s["order"] == list(plan.piece_names) for s in stats["per_step"].values()), stats["per_step"]
        assert stats["pieces"] == 8 and stats["plan_digest"] == plan.digest
        assert np.array_equal(arrays["a"].asnumpy(), np.ones((6, 8)))  # one worker: the sum is the value


@pytest.mark.timeout(60)
def test_a_missing_plan_or_a_plan_for_another_model_is_refused_on_one_worker():
    import mxnet as mx

    import commsched
    import commsched.plugins.mxnet as cmx
    from commsched.plan import PlanMismatch

    with pytest.raises(ValueError, match="needs a plan"):
        cmx.KVStore("local", commsched.SchedulerConfig(ordering="planned"))
    config = commsched.SchedulerConfig(ordering="planned", plan=_local_plan(), timeout_s=30)
    kv = cmx.KVStore("local", config)
    kv.init("a", mx.nd.ones((8, 6)))  # the plan says 6x8
    kv.init("b", mx.nd.ones((5,)))
    with pytest.raises(PlanMismatch, match=r"a: plan 48 elements of 4 B shape \[6, 8\].*shape \[8, 6\]"):
        kv.pushpull("a", mx.nd.ones((8, 6)))
    with pytest.raises(PlanMismatch):  # the store stays failed
        kv.pushpull("b", mx.nd.ones((5,)))
    with pytest.raises(PlanMismatch):
        kv.close()
