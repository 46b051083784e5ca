"""``ordering="planned"`` on TensorFlow, in one process: the plan's order, piece sizes and fused
groups written into the graph, the plan check, and the errors (the 2-worker run, bitwise
against stock MultiWorkerMirroredStrategy, and the mismatches on every worker are in
test_multiworker.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import commsched  # noqa: E402
from commsched.errors import OrderAgreementError  # noqa: E402
from commsched.plan import Plan, PlanGroup, PlanMismatch, PlannedPiece, fused_name  # noqa: E402
from commsched.plugins.tensorflow import DistributedGradientTape, plan_model  # noqa: E402
from commsched.plugins.tensorflow.backends import ReplicaGroup, _op_name  # noqa: E402
from commsched.plugins.tensorflow.reduction import GradientReducer, planned_tensor  # noqa: E402
from commsched.replay import PlanTensor  # noqa: E402
from commsched.replay import plan as replay  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SHAPES = {"0:k0": (10, 4), "1:b0": (4,), "2:k1": (4, 3), "3:b1": (3,)}
SMALL = fused_name(["1:b0", "3:b1"])
ORDER = [("2:k1", 1), (SMALL, 0), ("0:k0", 2), ("0:k0", 0), ("2:k1", 0), ("0:k0", 1)]


def values():
    return [tf.random.stateless_normal(shape, seed=[3, i]) for i, shape in enumerate(SHAPES.values())]


def make_plan(order=ORDER, algorithm="ring", model=None, nodes=1, ranks_per_node=1, credit=128) -> Plan:
    """k0 (160 B) in 64-byte pieces, k1 (48 B) in 32-byte pieces, the two biases fused (28 B)."""
    model = model or [planned_tensor(n, tf.zeros(s)) for n, s in SHAPES.items()]
    groups = (PlanGroup("0:k0", ("0:k0",), 64), PlanGroup(SMALL, ("1:b0", "3:b1"), 1024),
              PlanGroup("2:k1", ("2:k1",), 32))
    pieces = tuple(PlannedPiece(t, i, algorithm if t == "0:k0" else "ring") for t, i in order)
    return Plan(model=tuple(model), groups=groups, pieces=pieces, credit_bytes=credit, nodes=nodes,
                ranks_per_node=ranks_per_node)


def planned(plan: Plan) -> commsched.SchedulerConfig:
    return commsched.SchedulerConfig(ordering="planned", plan=plan, timeout_s=30)


def test_the_replay_of_a_plan_is_its_order_cut_at_each_groups_piece_size():
    plan = make_plan()
    tensors = [PlanTensor("0:k0", 40, 4, 0, ready=3.0), PlanTensor(SMALL, 7, 4, 1, ready=2.0),
               PlanTensor("2:k1", 12, 4, 2, ready=1.0)]
    schedule = replay(tensors, 1 << 20, plan.credit_bytes, slots=2, ordering="planned", plan=plan)
    assert schedule.order == list(plan.piece_names)
    assert [(p.start, p.stop) for p in schedule.by_tensor()[0]] == [(0, 16), (16, 32), (32, 40)]
    assert [(p.start, p.stop) for p in schedule.by_tensor()[2]] == [(0, 8), (8, 12)]
    with pytest.raises(OrderAgreementError, match="2:k1"):
        replay(tensors[:2], 1 << 20, plan.credit_bytes, ordering="planned", plan=plan)
    with pytest.raises(ValueError, match="needs plan="):
        replay(tensors, 1 << 20, 128, ordering="planned")


def test_the_graph_issues_the_plans_pieces_in_its_order_and_fused_groups_come_back_exact():
    plan = make_plan()
    reducer = GradientReducer(planned(plan))
    group = ReplicaGroup(1, 0, "/device:CPU:0")
    reducer._agree(values(), list(SHAPES), list(range(4)), [], group)  # one replica: checks, nothing to exchange
    assert reducer.plan is plan and reducer.slots == 128 // 64  # credit // the largest planned piece

    @tf.function
    def step(*vs):
        return reducer._reduce_planned(list(vs), list(SHAPES), group, plan)

    vs = values()
    out = step(*vs)
    for a, b in zip(out, vs, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # a sum over one replica, split back in place
    graph = step.get_concrete_function(*vs).graph
    ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert [op.name.split("commsched_")[-1] for op in ops] == [_op_name(n) for n in plan.piece_names]
    sizes = [int(op.inputs[0].shape.num_elements()) for op in ops]
    assert sizes == [4, 7, 8, 16, 8, 16]  # k1 at 32 B, the fused biases whole, k0 at 64 B


def test_a_plan_for_another_model_or_world_is_refused_naming_the_difference():
    other = [planned_tensor(n, tf.zeros(s)) for n, s in {**SHAPES, "2:k1": (2, 6)}.items()]
    grads = values()
    with pytest.raises(PlanMismatch, match=r"2:k1: plan 12 elements of 4 B shape \[2, 6\]"):
        GradientReducer(planned(make_plan(model=other))).reduce(grads, list(SHAPES))
    with pytest.raises(PlanMismatch, match="this run has 1"):
        GradientReducer(planned(make_plan(ranks_per_node=2))).reduce(grads, list(SHAPES))
    with pytest.raises(PlanMismatch, match=r"\['3:b1'\] have no gradient"):
        GradientReducer(planned(make_plan())).reduce(grads[:3] + [None], list(SHAPES))


def test_hierarchical_pieces_run_as_ring_with_a_warning(caplog):
    plan = make_plan(algorithm="hierarchical")
    reducer = GradientReducer(planned(plan))
    with caplog.at_level(logging.WARNING, logger="commsched.plugins.tensorflow.reduction"):
        out = reducer.reduce(values(), list(SHAPES))
    assert len(out) == 4 and reducer.plan is plan
    assert any("run as ring all-reduces" in r.getMessage() for r in caplog.records), caplog.text


def test_planned_without_a_plan_or_on_horovod_is_refused_at_construction():
    with pytest.raises(ValueError, match="needs a plan"):
        GradientReducer(commsched.SchedulerConfig(ordering="planned"))
    tape = tf.GradientTape()
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError:
        pytest.skip("horovod.tensorflow is not installed")
    with pytest.raises(ValueError, match="backend='collective'"):
        DistributedGradientTape(tape, config=planned(make_plan()), backend="horovod")


def test_plan_model_names_variables_as_the_optimizer_and_tape_do():
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    entries = plan_model(model.trainable_variables)
    assert [(e.name, e.shape, e.dtype, e.element_size) for e in entries] == [
        (f"0:{model.trainable_variables[0].path}", (3, 2), "float32", 4),
        (f"1:{model.trainable_variables[1].path}", (2,), "float32", 4)]


# ------------------------------------------------------------------ 2 workers
@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, tf_job):
    return tf_job("planned", tmp_path_factory.mktemp("planned"), timeout=240)


@pytest.mark.timeout(300)
def test_planned_training_on_two_workers_is_bitwise_equal_to_stock_mwms(two_workers):
    for r in two_workers:
        p = r["planned"]
        assert p["bitwise"], f"rank {r['rank']}: max |diff| {p['max_abs_diff']}"
        assert p["moved"] > 0 and p["iterations"] == 4


@pytest.mark.timeout(300)
def test_the_graph_holds_the_plans_order_sizes_and_slots_on_both_workers(two_workers):
    for r in two_workers:
        p = r["planned"]
        assert p["graph_order"] == p["plan_order"]
        assert p["graph"]["names"] == ["commsched_" + _op_name(n) for n in p["plan_order"]]
        # kernel1 (1920 B) in 768-byte pieces, the fused biases (58 floats) whole, kernel0 in 1 KiB pieces
        assert p["sizes"] == [384, 232, 768, 768, 1024, 1024, 768, 1024]
        assert p["slots"] == 2048 // 1024 and p["graph"]["tokens"] == 2 and p["graph"]["chained"]
        assert any("run as ring all-reduces" in w for w in p["warnings"]), p["warnings"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, words", [("other_model", "made for another model"),
                                         ("differs", "differs from rank 0's")])
def test_a_wrong_or_differing_plan_is_a_plan_mismatch_on_every_worker_without_a_hang(two_workers, case, words):
    for r in two_workers:
        got = r[case]
        assert got["error"] is not None, f"rank {r['rank']} trained with a {case} plan"
        assert got["is_plan_mismatch"], got["error"]
        assert got["seconds"] < 30, got  # at the first trace, not after a collective's timeout
    assert any(words in r[case]["error"] for r in two_workers), [r[case]["error"] for r in two_workers]
