"""``--strategies`` parsing (framework-free): the commsched kinds, planned and hierarchical included."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from commsched.bench.spec import parse_strategies


def test_planned_and_hierarchical_are_commsched_strategies():
    specs = parse_strategies("ddp,dynamic,planned,hierarchical")
    assert [s.kind for s in specs] == ["ddp", "dynamic", "planned", "hierarchical"]
    assert [s.is_commsched for s in specs] == [False, True, True, True]


def test_an_unknown_strategy_names_the_known_ones():
    with pytest.raises(ValueError, match="planned, hierarchical, hierarchical:<partition>/<credit>, slack or "
                                         "allreduce"):
        parse_strategies("plannedd")


def test_auto_is_a_commsched_strategy():
    from commsched.bench.spec import parse_strategies

    (spec,) = parse_strategies("auto")
    assert spec.kind == "auto" and spec.is_commsched


def test_slack_is_a_commsched_strategy():
    (spec,) = parse_strategies("slack")
    assert spec.kind == "slack" and spec.is_commsched


def test_sync_is_a_commsched_strategy_named_in_the_error():
    (spec,) = parse_strategies("sync")
    assert spec.kind == "sync" and spec.is_commsched
    with pytest.raises(ValueError, match="fifo, sync, "):
        parse_strategies("synch")


def test_reducer_is_a_commsched_strategy_with_ddps_bucket_sizes_in_the_bench_and_the_simulator():
    from commsched.costmodel.simulator import parse_sim_strategy

    plain, one = parse_strategies("reducer,reducer:1")
    assert (plain.kind, plain.bucket_mb, one.bucket_mb) == ("reducer", None, 1.0) and plain.is_commsched
    for bad in ("reducer:0", "reducer:x", "reducer:-4"):
        with pytest.raises(ValueError, match="positive number of MB, e.g. reducer:4"):
            parse_strategies(bad)
    with pytest.raises(ValueError, match="sync, reducer, reducer:<bucket MB>"):
        parse_strategies("reduce")
    # the simulator predicts it as DDP with those buckets (its engine is DDP's): 25 MiB unless given
    assert parse_sim_strategy("reducer").bucket_bytes == 25 << 20
    assert (parse_sim_strategy("reducer:4").kind, parse_sim_strategy("reducer:4").bucket_bytes) == ("ddp", 4 << 20)


def test_the_auto_warm_up_runs_while_the_tuner_searches_by_what_every_rank_knows():
    """The bench warms ``auto`` up until its tuner settles: judged from the agreed decisions (next and
    pending decision, switches), which every rank has alike, never from rank 0's private phase."""
    pytest.importorskip("torch")
    from commsched.plugins.torch.bench.worker import thread_cpu_delta, tuning, with_callbacks
    from commsched.plugins.torch.optimizer import TUNER_OPTIONS

    class Opt:
        def __init__(self, steps, **tuner):
            self._stats = {"steps": steps, "tuner": {"switches": [], "next_decision": None,
                                                     "pending_decision": None, **tuner}}

        def stats(self):
            return self._stats
    sample = TUNER_OPTIONS["settle"] + TUNER_OPTIONS["sample_steps"]
    assert tuning(Opt(1, next_decision=3))  # recording the first steps
    assert tuning(Opt(4, pending_decision=3))  # a decision taken, read at the next step
    assert tuning(Opt(11, next_decision=11 + sample - 1, switches=[{}]))  # a sample runs
    assert not tuning(Opt(30, next_decision=30 + TUNER_OPTIONS["check_every"], switches=[{}]))  # settled
    assert not tuning(Opt(30, switches=[{}]))  # no more decisions
    # the kept setting's first steps after the last switch warm up too (the tuner's settle steps): the
    # switch decided at the end of step 27 applies from step 29, which ends with 30 steps done
    kept = [{"applies_from": 20, "settings": {"ordering": "fifo"}},
            {"applies_from": 29, "settings": {"ordering": "reducer"}}]
    far = 29 + TUNER_OPTIONS["check_every"]
    assert tuning(Opt(29, next_decision=far, switches=kept))
    assert not tuning(Opt(29 + TUNER_OPTIONS["settle"], next_decision=far, switches=kept))
    assert not tuning(Opt(29, next_decision=far, switches=[*kept[:1], {"applies_from": 29, "settings": None}]))
    # scheduler threads replaced by a switch: counted thread by thread, never negative
    assert thread_cpu_delta({("dispatch", 1): 5.0}, {("dispatch", 2): 0.25}) == {"dispatch": 0.25}
    # the completions on gloo's threads (no commsched thread of their own) join as "callback", the same way
    assert with_callbacks({"dispatch": 0.5}, 1.0, 1.25) == {"dispatch": 0.5, "callback": 0.25}
    assert with_callbacks({"dispatch": 0.5}, 1.0, 0.125) == {"dispatch": 0.5, "callback": 0.125}
    assert with_callbacks({"dispatch": 0.5}, None, 0.125) == {"dispatch": 0.5}


def test_a_grid_point_names_its_own_piece_size_and_credit():
    from commsched.bench.spec import UNLIMITED_BYTES

    specs = parse_strategies("dynamic:1MiB/4MiB,static:256KiB/none,dynamic,hierarchical:4MiB/16MiB")
    assert [(s.kind, s.partition_bytes, s.credit_bytes) for s in specs] == [
        ("dynamic", 1 << 20, 4 << 20), ("static", 256 << 10, UNLIMITED_BYTES), ("dynamic", None, None),
        ("hierarchical", 4 << 20, 16 << 20)]
    assert all(s.is_commsched for s in specs)
    assert [s.name for s in specs] == ["dynamic:1MiB/4MiB", "static:256KiB/none", "dynamic", "hierarchical:4MiB/16MiB"]


@pytest.mark.parametrize("text, match", [
    ("dynamic:1MiB", r"dynamic:<partition>/<credit>, e\.g\. dynamic:1MiB/4MiB"),
    ("dynamic:lots/4MiB", r"'dynamic:lots/4MiB'.*partition='lots' is not a byte count.*or 'none'"),
    ("static:1MiB/0", r"credit='0' must be a positive number of bytes"),
    ("fifo:1MiB/4MiB", r"unknown strategy 'fifo:1MiB/4MiB'.*dynamic:<partition>/<credit>"),
])
def test_a_bad_grid_point_says_what_to_write(text, match):
    with pytest.raises(ValueError, match=match):
        parse_strategies(text)


def test_a_grid_point_runs_with_its_own_sizes_and_a_plain_one_with_the_runs(monkeypatch):
    pytest.importorskip("torch")
    import commsched.plugins.torch.bench.strategies as strategies

    made = []

    class Recorder:
        def __init__(self, model, make_opt, ordering, partition_bytes, credit_bytes, timeline, **kw):
            made.append((ordering, partition_bytes, credit_bytes))

    run_spec = {"partition_bytes": 4 << 20, "credit_bytes": 16 << 20}
    monkeypatch.setattr(strategies, "CommschedStrategy", Recorder)
    for spec in parse_strategies("dynamic:1MiB/none,dynamic,static:64KiB/2MiB"):
        strategies.make_strategy(spec, None, None, run_spec=run_spec, rank=0, timeline=None)
    assert made == [("dynamic", 1 << 20, strategies.UNLIMITED_BYTES), ("dynamic", 4 << 20, 16 << 20),
                    ("static", 64 << 10, 2 << 20)]


def test_modifiers_tied_and_whole_combine_on_commsched_strategies_only():
    (spec,) = parse_strategies("dynamic:2MiB/8MiB+whole")
    assert spec.whole_apply and not spec.split_tied and spec.partition_bytes == 2 << 20
    (spec,) = parse_strategies("dynamic+tied+whole")
    assert spec.whole_apply and spec.split_tied and spec.name == "dynamic+tied+whole"
    assert not parse_strategies("dynamic")[0].whole_apply
    for bad in ("ddp:4+whole", "dynamic+fast", "dynamic+whole+whole", "fifo+tied=1", "planned+fuse=1MiB",
                "ddp+fuse=1MiB", "fifo+fuse=1MiB+fuse=2MiB"):
        with pytest.raises(ValueError, match=r"\+tied .*\+whole .*\+fuse=<size>"):
            parse_strategies(bad)


def test_fuse_sets_a_strategys_own_fusion_threshold_in_the_bench_and_the_simulator(monkeypatch):
    pytest.importorskip("torch")
    import commsched.plugins.torch.bench.strategies as strategies
    from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec
    from commsched.costmodel.simulator import simulate
    from commsched.costmodel.topology import Link, Topology

    specs = parse_strategies("fifo+fuse=4MiB,dynamic:2MiB/8MiB+whole+fuse=0,sync+fuse=64KiB,dynamic")
    assert [s.fusion_bytes for s in specs] == [4 << 20, 0, 64 << 10, None]
    assert specs[1].whole_apply and specs[1].partition_bytes == 2 << 20
    for bad in ("fifo+fuse", "fifo+fuse=", "fifo+fuse=lots"):
        with pytest.raises(ValueError, match=r"fifo\+fuse"):
            parse_strategies(bad)
    # the torch strategy gets it as SchedulerConfig's fusion_bytes; without +fuse, the config's default
    made = []

    class Recorder:
        def __init__(self, model, make_opt, ordering, partition, credit, timeline, **kw):
            made.append((ordering, kw.get("fusion_bytes"), kw.get("cross_iteration", True)))
            self.optimizer = SimpleNamespace(_ranged=True)  # +whole turns it off

    monkeypatch.setattr(strategies, "CommschedStrategy", Recorder)
    run_spec = {"partition_bytes": 4 << 20, "credit_bytes": 16 << 20}
    for spec in specs:
        strategies.make_strategy(spec, None, None, run_spec=run_spec, rank=0, timeline=None)
    assert made == [("fifo", 4 << 20, True), ("dynamic", 0, True), ("fifo", 64 << 10, False), ("dynamic", None, True)]
    # the simulator reads the same names (commsched simulate predicts what the bench runs)
    prof = Profile(layers=tuple(LayerProfile(f"l{i}", forward_s=0.01, backward_s=0.02,
                                             tensors=(TensorSpec(f"w{i}", 16 << 10, 4),))  # 64 KiB each
                                for i in range(8)), per_piece_cpu_s=0.0)
    link = Link(alpha_s=1e-4, bandwidth=125e6)
    topo = Topology(nodes=2, ranks_per_node=1, intra=link, inter=link)
    assert simulate(prof, topo, "fifo+fuse=0").pieces_per_step == 8
    assert simulate(prof, topo, "fifo").pieces_per_step == 2  # the default, 256 KiB: four tensors a piece
    assert simulate(prof, topo, "fifo+fuse=4MiB").pieces_per_step == 1
    with pytest.raises(ValueError, match=r"\+fuse=<size>"):
        simulate(prof, topo, "planned+fuse=1MiB")


def test_noahead_noreports_nice_and_noverify_reach_the_torch_strategy(monkeypatch):
    pytest.importorskip("torch")
    import commsched.plugins.torch.bench.strategies as strategies
    specs = parse_strategies("dynamic+noahead,auto+noahead+tied,dynamic,static:1MiB/4MiB+noahead,"
                             "dynamic+noreports,auto+noreports+noahead,dynamic+nice=10+noreports,auto+nice=0,"
                             "fifo+noverify,sync+noverify+fuse=1MiB")
    assert [s.decide_ahead for s in specs] == [False, False, True, False, True, False, True, True, True, True]
    assert [s.ready_reports for s in specs] == [True, True, True, True, False, False, False, True, True, True]
    assert [s.thread_nice for s in specs] == [None] * 6 + [10, 0, None, None]
    assert [s.verify_order for s in specs] == [True] * 8 + [False, False]
    assert specs[-1].fusion_bytes == 1 << 20
    assert specs[1].split_tied and specs[1].name == "auto+noahead+tied"
    for bad in ("ddp+noahead", "ddp:4+noreports", "horovod+nice=3", "dynamic+noahead=1", "ddp+noverify"):
        with pytest.raises(ValueError, match=r"\+noahead.*\+noreports.*\+nice=<n>.*\+noverify"):
            parse_strategies(bad)
    for bad in ("dynamic+nice", "dynamic+nice=20", "auto+nice=low"):
        with pytest.raises(ValueError, match=r"must be a whole number from 0 to 19.*e\.g\. dynamic\+nice=10"):
            parse_strategies(bad)
    made = []

    class Recorder:
        def __init__(self, model, make_opt, ordering, partition, credit, timeline, **kw):
            made.append((ordering, kw["decide_ahead"], kw["ready_reports"], kw["thread_nice"], kw["verify_order"]))

    monkeypatch.setattr(strategies, "CommschedStrategy", Recorder)
    run_spec = {"partition_bytes": 4 << 20, "credit_bytes": 16 << 20, "world_size": 2, "nodes": 2,
                "bandwidth": "1gbit"}
    for spec in specs:
        strategies.make_strategy(spec, None, None, run_spec=run_spec, rank=0, timeline=None)
    assert made == [("dynamic", False, True, None, True), ("auto", False, True, None, True),
                    ("dynamic", True, True, None, True), ("static", False, True, None, True),
                    ("dynamic", True, False, None, True), ("auto", False, False, None, True),
                    ("dynamic", True, False, 10, True), ("auto", True, True, 0, True),
                    ("fifo", True, True, None, False), ("fifo", True, True, None, False)]


def test_order_forces_the_plans_order_on_planned_only(monkeypatch):
    specs = parse_strategies("planned,planned+order=priority,planned+tied+order=observed,planned+order=fixed")
    assert [s.plan_order for s in specs] == [None, "priority", "observed", "fixed"]
    assert specs[2].split_tied and all(s.kind == "planned" for s in specs)
    for bad in ("dynamic+order=priority", "ddp+order=fixed", "planned+order=fixed+order=fixed"):
        with pytest.raises(ValueError, match=r"\+order=<fixed\|priority\|observed> \(planned only"):
            parse_strategies(bad)
    for bad in ("planned+order=sideways", "planned+order"):
        with pytest.raises(ValueError, match=rf"'{re.escape(bad)}': \+order takes one of fixed, priority, "
                                             r"observed \(e\.g\. planned\+order=priority\)"):
            parse_strategies(bad)
    pytest.importorskip("torch")
    import commsched.plugins.torch.bench.strategies as strategies

    made = []

    class Recorder:
        def __init__(self, model, make_opt, run_spec, rank, timeline, **kw):
            made.append((kw["split_tied"], kw["order"]))

    monkeypatch.setattr(strategies, "PlannedStrategy", Recorder)
    for spec in specs:
        strategies.make_strategy(spec, None, None, run_spec={}, rank=0, timeline=None)
    assert made == [(False, None), (False, "priority"), (True, "observed"), (False, "fixed")]


def test_a_planned_rounds_report_says_which_order_was_forced_over_the_planners():
    from commsched.bench.report import ROUND_PLAN_KEYS, round_plan

    info = {"digest": "b" * 64, "predicted": {"step_time_s": 1.2, "order_forced": {
        "planner_order": "fixed", "planner_digest": "a" * 64, "planner_step_s": 1.1}},
        "groups": 3, "pieces": 9, "credit_bytes": 4 << 20, "algorithms": ["hierarchical"], "order": "priority"}
    row = round_plan({"plan_file": info})
    assert set(row) == set(ROUND_PLAN_KEYS)
    assert (row["order"], row["planner_order"], row["planner_digest"]) == ("priority", "fixed", "a" * 64)
    info["predicted"] = {"step_time_s": 1.1}
    assert round_plan({"plan_file": info})["planner_order"] is None


def test_direct_reaches_every_commsched_strategy_as_direct_start_on(monkeypatch):
    specs = parse_strategies("dynamic+direct,dynamic,static:1MiB/4MiB+direct,auto+direct+noahead,fifo+direct,"
                             "planned+direct")
    assert [s.direct_start for s in specs] == [True, False, True, True, True, True]
    for bad in ("ddp+direct", "horovod+direct", "dynamic+direct+direct", "dynamic+direct=1"):
        with pytest.raises(ValueError, match=r"\+direct \(a completion or a delivered decision starts what it freed"):
            parse_strategies(bad)
    pytest.importorskip("torch")
    import commsched.plugins.torch.bench.strategies as strategies

    made = []

    class Recorder:
        def __init__(self, model, make_opt, *args, **kw):
            made.append(kw["direct_start"])

    monkeypatch.setattr(strategies, "CommschedStrategy", Recorder)
    monkeypatch.setattr(strategies, "PlannedStrategy", Recorder)
    run_spec = {"partition_bytes": 4 << 20, "credit_bytes": 16 << 20, "world_size": 2, "nodes": 2,
                "bandwidth": "1gbit"}
    for spec in specs:
        strategies.make_strategy(spec, None, None, run_spec=run_spec, rank=0, timeline=None)
    assert made == [True, False, True, True, True, True]
