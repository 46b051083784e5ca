"""``report()`` / ``stats()`` of the TensorFlow plugin, from the stamps the graph writes.

Collectives with a group of one run locally, so the measured pieces are real
``CollectiveReduceV2`` runs; the 2-worker numbers are checked in test_multiworker.py.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import commsched  # noqa: E402
from commsched.costmodel.topology import Topology  # noqa: E402
from commsched.plugins.tensorflow import report as process_report  # noqa: E402
from commsched.plugins.tensorflow.backends import ReplicaGroup  # noqa: E402
from commsched.plugins.tensorflow.measure import Recorder, Run  # noqa: E402
from commsched.plugins.tensorflow.reduction import GradientReducer  # noqa: E402
from commsched.plugins.tensorflow.stats import inferred_profile  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CONFIG = commsched.SchedulerConfig(partition_bytes=64, credit_bytes=192, fusion_bytes=0, timeout_s=30)
SHAPES = [(10, 4), (4,), (4, 3), (3,)]  # 160 + 16 + 48 + 12 bytes of float32


def _values():
    return [tf.random.stateless_normal(shape, seed=[1, i]) for i, shape in enumerate(SHAPES)]


def _compiled(reducer):
    group = ReplicaGroup(1, 0, "/device:CPU:0")

    @tf.function
    def step(*vs):
        return reducer._reduce_dense(list(vs), [f"v{i}" for i in range(len(vs))], group)

    return step


def test_stats_count_every_run_and_measure_all_but_the_warm_up_run():
    reducer = GradientReducer(CONFIG)
    step, values = _compiled(reducer), _values()
    for _ in range(6):
        out = step(*values)
    for a, b in zip(out, values, strict=True):  # the stamps never touch the data
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    stats = reducer.stats()
    assert stats["steps"] == 6 and stats["measured_steps"] == 5 and stats["traces"] == 1
    assert stats["bytes_per_step"] == 4 * (40 + 4 + 12 + 3)
    assert stats["pieces_per_step"] == len(reducer.plans[-1].pieces) == 6
    # after the last gradient, some piece is in flight until the last one lands
    assert 0 < stats["comm_s"] < 5 and 0 <= stats["exposed_comm_s"] <= stats["comm_s"] + 1e-6
    assert stats["effective_bandwidth_bytes_s"] > 0 and 0 <= stats["overlap_ratio"] <= 1
    assert stats["settings"]["slots"] == 3 and stats["settings"]["ordering"] == CONFIG.ordering


def test_each_run_stamps_every_piece_between_its_data_and_its_result():
    reducer = GradientReducer(CONFIG)
    step, values = _compiled(reducer), _values()
    for _ in range(4):
        step(*values)
    record = reducer.records[-1]
    slots = [p.slot for p in record.plan.pieces]
    runs = record.recorder.runs()
    assert len(runs) == 4 and record.recorder.slots == tuple(slots)
    for run in runs:
        assert np.all(run.ready <= run.issue) and np.all(run.issue <= run.done)
        for slot in set(slots):
            chain = [k for k, s in enumerate(slots) if s == slot]
            for before, after in zip(chain, chain[1:], strict=False):
                # a chain's piece starts after the one before, or, when the one before's done stamp
                # ran after this piece's own (stamp jitter, seen in CI), at its own done
                assert run.issue[after] >= run.done[before] or run.issue[after] == run.done[after]
    # (that the pieces of a chain *land* in plan order is checked on 2 workers, where a collective
    # takes milliseconds: a local one is over in microseconds, below the stamps' scheduling jitter)


def _process_steps() -> int:
    return int(re.search(r"after (\d+) steps", process_report()).group(1))


def test_report_says_what_it_measured_and_what_it_did_not():
    before = _process_steps()
    reducer = GradientReducer(CONFIG)
    assert "nothing reduced yet" in reducer.report()
    step, values = _compiled(reducer), _values()
    step(*values)
    text = reducer.report()
    assert "after 1 steps" in text and "0.24 kB in 6 pieces" in text
    assert "times: not measured yet" in text  # only the warm-up run so far: no zeros printed
    for _ in range(3):
        step(*values)
    text = reducer.report()
    assert "measured in the graph over 3 step(s)" in text and "effective bandwidth" in text
    assert "not measured: how much of that exposed time the next forward hides under unroll" in text
    assert "partition_bytes=64" in text and "credit_bytes=192" in text and "slots=3" in text
    assert "pass topology=" in text
    assert _process_steps() == before + 4  # the process-wide report counts this reducer's steps too


def test_with_a_topology_the_report_adds_the_networks_time_and_the_simulators_step():
    reducer = GradientReducer(CONFIG)
    step, values = _compiled(reducer), _values()
    for _ in range(3):
        step(*values)
    topology = Topology.emulated(2, None, "1gbit")
    text = reducer.report(topology)
    assert "the network should take" in text and "the simulator (dynamic" in text
    record = reducer.records[-1]
    profile = inferred_profile(record, record.recorder.runs()[-1])
    assert [t.name for layer in profile.layers for t in layer.tensors] == ["v0", "v1", "v2", "v3"]
    assert sum(t.nbytes for layer in profile.layers for t in layer.tensors) == 4 * (40 + 4 + 12 + 3)


def test_with_fusion_the_inferred_profile_puts_a_fused_group_at_its_first_members_place():
    reducer = GradientReducer(dataclasses.replace(CONFIG, fusion_bytes=32))  # v1 (16 B) and v3 (12 B) fused
    step, values = _compiled(reducer), _values()
    for _ in range(3):
        step(*values)
    text = reducer.report(Topology.emulated(2, None, "1gbit"))
    assert "in 5 pieces" in text and "fusion_bytes=32" in text and "the simulator (dynamic" in text
    record = reducer.records[-1]
    profile = inferred_profile(record, record.recorder.runs()[-1])
    assert [t.name for layer in profile.layers for t in layer.tensors] == ["v0", "fused[v1..v3](2)", "v2"]
    assert sum(t.nbytes for layer in profile.layers for t in layer.tensors) == 4 * (40 + 4 + 12 + 3)


def test_eager_steps_share_one_recorder_per_plan():
    reducer = GradientReducer(CONFIG)
    group, values = ReplicaGroup(1, 0, "/device:CPU:0"), _values()
    for _ in range(3):
        reducer._reduce_dense(values, [f"v{i}" for i in range(len(values))], group)
    assert len(reducer.records) == 1 and reducer.records[-1].recorder.count == 3


def test_the_ring_keeps_the_newest_runs():
    recorder = Recorder([0, 1], capacity=3)

    @tf.function
    def run(t):
        recorder.record(t, [t + 1.0, t + 2.0], [t + 3.0, t + 4.0])

    for k in range(5):
        run(tf.constant(float(10 * k), tf.float64))
    assert recorder.count == 5
    assert [r.start for r in recorder.runs()] == [20.0, 30.0, 40.0]
    assert recorder.runs()[-1].issue.tolist() == [41.0, 42.0]
    with pytest.raises(ValueError, match="n >= 1"):
        Recorder([])


def test_a_late_done_stamp_of_the_piece_before_never_puts_an_issue_after_its_done():
    # slot 0 chain: piece 0's done stamp (5.0) ran after piece 1 finished (4.0; stamp jitter)
    run = Run(start=0.0, ready=np.array([1.0, 2.0, 1.5]), done=np.array([5.0, 4.0, 3.0]), slots=(0, 0, 1))
    assert run.issue.tolist() == [1.0, 4.0, 1.5]
    assert run.comm_s == pytest.approx(4.0)  # the union of [1, 5], [4, 4] and [1.5, 3]


def test_measure_false_writes_no_stamps_but_still_counts_steps_bytes_and_pieces():
    reducer = GradientReducer(CONFIG, measure=False)
    step, values = _compiled(reducer), _values()
    for _ in range(3):
        step(*values)
    graph = step.get_concrete_function(*values).graph
    assert not [op for op in graph.get_operations() if op.type in ("Timestamp", "StatefulPartitionedCall")]
    stats = reducer.stats()
    assert stats["steps"] == 3 and stats["pieces_per_step"] == 6 and stats["measured_steps"] == 0
    assert stats["comm_s"] is None and stats["exposed_comm_s"] is None  # None, never a made-up zero
    assert "times: not measured (measure=False" in reducer.report()
    with pytest.raises(TypeError, match="measure must be True or False"):
        GradientReducer(CONFIG, measure="yes")


def _fed_record(members, runs):
    """A trace of two 40-byte pieces (``a`` then ``b``, chains 0 and 1) whose graph wrote ``runs``:
    (start, [ready a, ready b], [done a, done b]) each."""
    from commsched.plugins.tensorflow.stats import TraceRecord
    from commsched.replay import PlanTensor, plan

    schedule = plan([PlanTensor("a", 10, 4, 0, 0.0), PlanTensor("b", 10, 4, 1, 0.0)], 40, 80, slots=2)
    assert [p.name for p in schedule.pieces] == ["a#0", "b#0"]
    recorder = Recorder([p.slot for p in schedule.pieces], capacity=8)

    @tf.function
    def write(start, ready, done):
        recorder.record(start, [ready[0], ready[1]], [done[0], done[1]])

    for start, ready, done in runs:
        write(tf.constant(start, tf.float64), tf.constant(ready, tf.float64), tf.constant(done, tf.float64))
    return TraceRecord(schedule, recorder, {}, (), members)


def test_observed_readiness_is_the_median_order_and_link_rate_of_a_trace_of_the_same_gradients():
    from commsched.plugins.tensorflow.stats import observed_readiness

    # The first run is left out (it sets up the group); then b is ready before a, by 2, 4 and 3 ms,
    # and both pieces are in flight together for 10 ms: 80 bytes / 10 ms.
    runs = [(0.0, [50.0, 50.0], [90.0, 90.0])]
    runs += [(t, [t + 0.001 + gap, t + 0.001], [t + 0.011, t + 0.011])
             for t, gap in ((1.0, 0.002), (2.0, 0.004), (3.0, 0.003))]
    record = _fed_record((("a",), ("b", "c")), runs)
    seen = observed_readiness([record], ["c", "b", "a"])
    assert seen["runs"] == 3
    assert seen["ready"] == {"a": pytest.approx(0.003), "b": 0.0, "c": 0.0}  # c: fused with b
    assert seen["link_bytes_per_s"] == pytest.approx(80 / 0.010)
    assert observed_readiness([record], ["a", "b"]) is None  # another set of gradients
    assert observed_readiness([record], ["a", "b", "c"], min_runs=4) is None  # not measured enough
    assert observed_readiness([_fed_record((("a",), ("b", "c")), runs[:2])], ["a", "b", "c"]) is None


def test_static_plans_its_next_trace_from_what_the_first_measured(monkeypatch):
    # ordering="static": the first trace plans from the model; a new trace of the same gradients plans
    # from the order and link rate observed (here: what observed_readiness returns), on a shared link.
    import commsched.plugins.tensorflow.reduction as reduction

    reducer = GradientReducer(dataclasses.replace(CONFIG, ordering="static"))
    step = _compiled(reducer)
    values = _values()
    for _ in range(3):
        step(*values)
    first = reducer.plans[-1]
    assert [p.name for p in first.pieces][0] == "v3#0"  # the model: the last gradient is ready first
    seen = reduction.observed_readiness(reducer.records, [f"v{i}" for i in range(4)])
    assert seen is not None and seen["runs"] == 2 and set(seen["ready"]) == {"v0", "v1", "v2", "v3"}
    assert reducer.records[-1].members == (("v0",), ("v1",), ("v2",), ("v3",))
    observed = {"ready": {"v0": 0.0, "v1": 0.0, "v2": 0.0, "v3": 0.0}, "link_bytes_per_s": 1e6, "runs": 2}
    calls = []

    def fake(records, names):
        calls.append(list(names))
        return observed

    monkeypatch.setattr(reduction, "observed_readiness", fake)
    out = _compiled(reducer)(*values)  # a new tf.function: traced again
    for a, b in zip(out, values, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert calls == [[f"v{i}" for i in range(4)]]
    second = reducer.plans[-1]
    assert [p.name for p in second.pieces][:3] == ["v0#0", "v0#1", "v0#2"]  # all ready at once: by priority
    assert second is not first and sorted(p.name for p in second.pieces) == sorted(p.name for p in first.pieces)


def test_function_traces_a_static_step_again_once_at_the_retrace_call():
    from commsched.plugins.tensorflow import function
    from commsched.plugins.tensorflow.functions import RETRACE_AT_CALL
    from commsched.plugins.tensorflow.reduction import static_pending

    reducer = GradientReducer(dataclasses.replace(CONFIG, ordering="static"))
    group, values = ReplicaGroup(1, 0, "/device:CPU:0"), _values()
    traces = []

    def body(*vs):
        traces.append(len(reducer.plans))
        return reducer._reduce_dense(list(vs), [f"v{i}" for i in range(len(vs))], group)

    step = function(body)
    step(*values)
    assert reducer.settings()["planned_from"] == "model"
    for call in range(2, RETRACE_AT_CALL + 3):
        out = step(*values)
        assert static_pending() == (call < RETRACE_AT_CALL)
    assert len(traces) == 2  # the first call, and once more at RETRACE_AT_CALL
    assert reducer.settings()["planned_from"] == "observed (2 runs)"
    assert "planned_from=observed (2 runs)" in reducer.report()
    for a, b in zip(out, values, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert len(reducer.records) == 2 and reducer.records[-1].recorder.count == 3
    # dynamic: never traced again
    dynamic = GradientReducer(CONFIG)
    again = function(lambda *vs: dynamic._reduce_dense(list(vs), [f"v{i}" for i in range(len(vs))], group))
    for _ in range(RETRACE_AT_CALL + 1):
        again(*values)
    assert len(dynamic.plans) == 1 and "planned_from" not in dynamic.settings()
    reducer.close()


def test_function_traces_again_only_for_a_static_reducer_its_own_trace_used():
    # a static reducer still planned from the model makes its own step trace again, not every compiled
    # step of the process (an evaluation step, another model's step)
    from commsched.plugins.tensorflow import function
    from commsched.plugins.tensorflow.functions import RETRACE_AT_CALL
    from commsched.plugins.tensorflow.reduction import static_pending

    group, values = ReplicaGroup(1, 0, "/device:CPU:0"), _values()
    names = [f"v{i}" for i in range(len(values))]
    waiting = GradientReducer(dataclasses.replace(CONFIG, ordering="static"))
    first = function(lambda *vs: waiting._reduce_dense(list(vs), names, group))
    first(*values)  # traced from the model, and not called again: it stays pending
    other = GradientReducer(CONFIG)
    second = function(lambda *vs: other._reduce_dense(list(vs), names, group))
    for _ in range(RETRACE_AT_CALL + 1):
        second(*values)
        assert static_pending() and not static_pending(second._reducers)
    assert len(other.plans) == 1  # traced once: the pending reducer is not its own
    assert set(first._reducers) == {waiting} and static_pending(first._reducers)
    waiting.close()
    assert not static_pending(first._reducers)


def test_eager_static_steps_observe_nothing_and_ask_for_no_retrace():
    from commsched.plugins.tensorflow.reduction import static_pending

    reducer = GradientReducer(dataclasses.replace(CONFIG, ordering="static"))
    group, values = ReplicaGroup(1, 0, "/device:CPU:0"), _values()
    for _ in range(3):  # eagerly every step plans anew, pieces one after another: nothing to observe
        reducer._reduce_dense(values, [f"v{i}" for i in range(len(values))], group)
    assert not static_pending() and reducer.settings()["planned_from"] == "model"
    assert len(reducer.plans) == 3 and all(p.order == reducer.plans[0].order for p in reducer.plans)
