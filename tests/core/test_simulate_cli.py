"""`commsched simulate`, `advise` and the pieces of `validate`: contracts and the report schema."""

from __future__ import annotations

import dataclasses
import json

import pytest

from commsched.bench.report import BASELINE_KEYS, REPORT_KEYS, RESULT_KEYS
from commsched.cli import main
from commsched.costmodel.cli import (ADVISE_CREDIT_MB, ADVISE_PARTITION_MB, _grid, advise, advise_grid,
                                     compute_beside_allreduce_s, kendall_tau)
from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec
from commsched.costmodel.topology import Topology

MB = 1 << 20


def _profile(tmp_path, layer0_mb: float = 1.0) -> str:
    layers = tuple(LayerProfile(f"l{i}", 0.01, 0.02, (TensorSpec(f"l{i}.w", int(mb * MB) // 4),), apply_s=0.001)
                   for i, mb in enumerate([layer0_mb, 4, 4, 8]))
    path = tmp_path / "p.json"
    Profile(layers=layers, batch_size=32, source="test").to_json(str(path))
    return str(path)


def test_simulate_writes_the_bench_schema_marked_predicted(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--profile", _profile(tmp_path), "--workers", "2", "--bandwidth", "1gbit",
               "--strategies", "ddp,ddp:4,fifo,dynamic,static,allreduce", "--json", str(out),
               "--timelines", str(tmp_path / "tl")])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report) == set(REPORT_KEYS) and report["predicted"] is True
    assert [r["strategy"] for r in report["results"]] == ["ddp", "ddp:4", "fifo", "dynamic", "static", "allreduce"]
    for r in report["results"]:
        assert set(r) == set(RESULT_KEYS) and r["status"] == "ok" and r["step_time_s"] > 0
        assert json.loads(open(r["timeline"]).read())["traceEvents"]
    by = {r["strategy"]: r for r in report["results"]}
    assert by["ddp"]["speedup_vs_baseline"] == pytest.approx(1.0)
    assert by["allreduce"]["step_time_s"] >= max(by[s]["step_time_s"] for s in ("ddp", "dynamic"))
    assert "| strategy |" in capsys.readouterr().out
    assert report["config"]["extra"]["handoff_s"] == 0.0 and by["dynamic"]["stats"]["handoffs_per_step"] == 0
    # the dependency bound (costmodel.bounds): communication-bound, and the link cannot start before
    # the last layer's gradient (first in backward) nor finish after the next forward reaches it
    base = report["baseline"]
    assert list(base) == list(BASELINE_KEYS)
    assert base["dependency_layer"] == "l3" and base["dependency_bound_s"] > base["lower_bound_s"]
    assert all(r["step_time_s"] >= base["dependency_bound_s"] * (1 - 1e-9) for r in report["results"])
    assert base["combined_bound_s"] == max(base["contended_bound_s"], base["dependency_bound_s"])
    dynamic = by["dynamic"]
    assert dynamic["efficiency_combined"] == pytest.approx(base["combined_bound_s"] / dynamic["step_time_s"])


def test_compute_beside_one_all_reduce_is_slowed_only_while_it_runs():
    layers = (LayerProfile("l0", 0.25, 0.5, (TensorSpec("l0.w", MB),), apply_s=0.25),)  # compute 1.0 s
    prof = Profile(layers=layers, batch_size=1, source="test", contention=2.0, comm_contention=1.5)
    assert prof.compute_s == pytest.approx(1.0)
    # the all-reduce runs 0.4 x 1.5 = 0.6 s beside compute, half of which is lost: 1.3 s
    assert compute_beside_allreduce_s(prof, 0.4) == pytest.approx(1.3)
    # one that outlasts the compute slows all of it: 2.0 s
    assert compute_beside_allreduce_s(prof, 3.0) == pytest.approx(2.0)
    assert compute_beside_allreduce_s(dataclasses.replace(prof, contention=1.0), 0.4) == pytest.approx(1.0)


def test_simulate_reports_the_pieces_that_waited_the_profiles_handoff(tmp_path):
    path = _profile(tmp_path)
    data = json.loads(open(path).read())
    data["handoff_s"] = 0.002
    open(path, "w").write(json.dumps(data))
    out = tmp_path / "sim.json"
    # 1 MiB pieces under a 1 MiB credit: every piece after the first of a run of waiting ones waits
    assert main(["simulate", "--profile", path, "--workers", "2", "--bandwidth", "1gbit", "--strategies",
                 "fifo,dynamic", "--partition-mb", "1", "--credit-mb", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by = {r["strategy"]: r["stats"]["handoffs_per_step"] for r in report["results"]}
    assert report["config"]["extra"]["handoff_s"] == 0.002 and by["fifo"] == 0 and by["dynamic"] > 0


def test_simulate_a_zoo_model_on_a_described_cluster(tmp_path):
    out = tmp_path / "z.json"
    assert main(["simulate", "--model", "gpt-7b", "--cluster", "16x8", "--intra", "900GB/s", "--inter", "100gbit",
                 "--strategies", "ddp,dynamic", "--partition-mb", "16", "--credit-mb", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["workers"] == 128 and report["workload"]["description"] == "zoo:gpt-7b@h100"
    comm = report["baseline"]["comm_s"]
    assert all(r["step_time_s"] >= comm for r in report["results"])  # no schedule beats the all-reduce
    assert not any("latency steps" in w for w in report["warnings"])  # 16 MiB: the smallest advise weighs here


def test_simulate_warns_where_pieces_are_too_small_for_the_models_gradients(tmp_path, capsys):
    """Over 1 GiB of gradients, a piece size below the grid advise weighs for them gets a warning per
    dynamic/static row: its step says more about per-piece latency than about scheduling."""
    out = tmp_path / "z.json"
    assert main(["simulate", "--model", "gpt-7b", "--cluster", "2x2", "--intra", "900GB/s", "--inter", "100gbit",
                 "--strategies", "ddp,dynamic,static", "--partition-mb", "4", "--credit-mb", "16",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    small = [w for w in report["warnings"] if "latency steps" in w]
    assert [w.split(":")[0] for w in small] == ["dynamic", "static"]
    assert "of 4 MiB on 4 ranks" in small[0] and "commsched advise` weighs 16-256 MiB pieces" in small[0]
    assert "latency steps" in capsys.readouterr().out  # the table's warnings


@pytest.mark.parametrize("argv,needle", [
    (["--workers", "2", "--bandwidth", "1gbit"], "name the model"),
    (["--model", "gpt-7b"], "name the network"),
    (["--model", "gpt-7b", "--cluster", "16x8", "--bandwidth", "1gbit"], "name the network once"),
    (["--model", "nope", "--cluster", "2x2"], "nope"),
    (["--model", "gpt-7b", "--cluster", "16-8"], "NODESxRANKS"),
    (["--model", "gpt-7b", "--cluster", "2x2", "--strategies", "ddp,bogus"], "bogus"),
    (["--model", "gpt-7b", "--cluster", "2x2", "--partition-mb", "1e-9"], "--partition-mb"),
])
def test_bad_simulate_flags_get_a_clear_error_and_exit_2(argv, needle, capsys):
    assert main(["simulate", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_advise_says_no_where_backward_hides_communication_and_yes_where_it_cannot(tmp_path):
    fast = Topology.emulated(2, None, "100gbit")
    hidden = advise(Profile.from_json(_profile(tmp_path)), fast)
    assert hidden["helps"] is False and "already hides" in " ".join(hidden["reasons"])
    slow = Topology.emulated(2, None, "500mbit")
    heavy = advise(Profile.from_json(_profile(tmp_path)), slow)
    assert heavy["expected_speedup_vs_ddp"] > 1.03 and heavy["helps"] is True
    assert heavy["efficiency"] <= 1.0 + 1e-9


def test_advise_names_the_layer_whose_dependency_no_schedule_hides(tmp_path):
    # a 16 MiB first layer, ready last in backward and needed first: at 10 Gbit/s communication is
    # short of compute, yet layer 0's all-reduce starts when backward ends and the next forward waits
    prof = Profile.from_json(_profile(tmp_path, layer0_mb=16))
    out = advise(prof, Topology.emulated(2, None, "10gbit"))
    assert out["dependency_bound_s"] > out["lower_bound_s"] * 1.03
    assert out["commsched_step_s"] >= out["dependency_bound_s"] * (1 - 1e-9)
    assert any("no schedule of whole gradients beats" in r and "every layer up to l0" in r for r in out["reasons"])
    # a small first layer adds nothing worth a reason
    small = advise(Profile.from_json(_profile(tmp_path, layer0_mb=0.01)), Topology.emulated(2, None, "10gbit"))
    assert not any("no schedule of whole gradients" in r for r in small["reasons"])


def test_advise_departs_from_the_default_only_for_a_gain_beyond_the_models_error(tmp_path):
    # comm-heavy on this machine: the model put 4 MiB / 4 MiB 2.1 % ahead of 1 MiB / 4 MiB, which ran
    # 5-10 % faster; a gain inside the margin keeps the settings a user runs without advice
    prof, topo = Profile.from_json(_profile(tmp_path)), Topology.emulated(2, None, "500mbit")
    usual = {"ordering": "dynamic", "partition_bytes": 16 * MB, "credit_bytes": 16 * MB}  # one piece in flight
    free = advise(prof, topo, default=usual, margin=0.0)  # any predicted gain moves it
    best = free["best_candidate"]
    gain = 1 - best["step_s"] / free["default"]["step_s"]
    assert gain > 0 and free["kept_default"] is False and free["settings"] == best["settings"] != usual
    assert free["commsched_step_s"] == pytest.approx(best["step_s"])
    kept = advise(prof, topo, default=usual, margin=gain + 0.01)  # the same gain, now inside the margin
    assert kept["kept_default"] is True and kept["settings"] == usual and kept["best_candidate"] == best
    assert kept["commsched_step_s"] == pytest.approx(kept["default"]["step_s"])
    assert kept["expected_speedup_vs_ddp"] == pytest.approx(kept["best_ddp_step_s"] / kept["default"]["step_s"])
    assert any("inside the model's error" in r and "default dynamic partition=16MiB credit=16MiB" in r
               for r in kept["reasons"])
    # the model's own best as the default: nothing to say
    same = advise(prof, topo, default=best["settings"])
    assert same["settings"] == best["settings"] and not any("model's error" in r for r in same["reasons"])
    # no default given: SchedulerConfig()'s, and the planner's margin
    plain = advise(prof, topo)
    assert plain["margin"] == 0.05 and plain["default"]["settings"]["partition_bytes"] == 4 * MB


def test_advise_weighs_pieces_as_large_as_the_model_needs(tmp_path):
    """A 7B decoder over 4 x 8 ranks: every piece pays the ring's 2(n - 1) latencies, so 1-16 MiB pieces
    simulate no better than DDP (the small grid's best was 0.98x); the grid of a model over 1 GiB of
    gradients is the planner's (16-256 MiB pieces), and there scheduling helps. A small model keeps
    the small grid."""
    from commsched.costmodel.planner import PlanSearch
    from commsched.costmodel.zoo import zoo_profile

    prof = zoo_profile("gpt-7b")
    topo = Topology.described("4x8", "900GB/s", "100gbit")
    search = PlanSearch.for_profile(prof)
    assert advise_grid(prof) == (tuple(p / MB for p in search.partitions), tuple(c / MB for c in search.credits))
    assert min(advise_grid(prof)[0]) >= 16
    out = advise(prof, topo)
    assert out["helps"] is True and out["expected_speedup_vs_ddp"] > 1.05
    assert out["settings"]["ordering"] == "dynamic" and out["settings"]["partition_bytes"] >= 16 * MB
    small = advise(prof, topo, partition_mb=ADVISE_PARTITION_MB, credit_mb=ADVISE_CREDIT_MB)
    assert small["expected_speedup_vs_ddp"] < out["expected_speedup_vs_ddp"] / 1.05
    assert advise_grid(Profile.from_json(_profile(tmp_path))) == (ADVISE_PARTITION_MB, ADVISE_CREDIT_MB)


def test_advise_names_the_planners_two_level_plan_where_only_a_plan_runs_the_faster_algorithm(tmp_path, capsys):
    """2 nodes x 4 ranks, a 1 Gbit/s link per node: the flat ring pushes 1.75x the gradient through each
    node's link, the two-level algorithm 1x, and only a plan runs it (its subgroups). Every runtime setting
    stays a flat ring, so the advice names the planner's plan with its own prediction, and the command
    that makes it; one node (or a two-level network whose algorithm gains nothing) has no such plan."""
    from commsched.costmodel.cli import two_level_plan
    from commsched.costmodel.planner import PlanSearch, make_plan

    prof = Profile.from_json(_profile(tmp_path))
    topo = Topology.described("2x4", "100gbit", "1gbit")
    out = advise(prof, topo)
    planned = out["planned"]
    assert planned["recommended"] is True and out["helps"] is True
    assert planned["step_s"] < out["commsched_step_s"] * (1 - out["margin"])
    assert planned["speedup_vs_ddp"] == pytest.approx(out["best_ddp_step_s"] / planned["step_s"])
    assert planned["two_level_pieces"] > 0 and planned["pieces"] >= planned["two_level_pieces"]
    assert any("only a plan runs the two-level" in r and "ordering=\"planned\"" in r for r in out["reasons"])
    # the runtime settings stay what runs without a plan file (the tuner's start reads them)
    assert out["settings"]["ordering"] in ("fifo", "dynamic")
    # auto's starts make the planner's own plan: their advice builds none, and its settings are the same
    bare = advise(prof, topo, weigh_plan=False)
    assert bare["planned"] is None and bare["settings"] == out["settings"]
    # the planner, searching further, predicts no slower than the advice's plan (up to its tie tolerance)
    made = make_plan(prof, topo, time_limit_s=1.0)
    assert made.step_time_s <= planned["step_s"] * (1 + PlanSearch.tie_tolerance) + 1e-9
    # the command line: the same model and network flags, and `commsched plan` reads them
    path = tmp_path / "advice.json"
    assert main(["advise", "--profile", _profile(tmp_path), "--cluster", "2x4", "--intra", "100gbit", "--inter",
                 "1gbit", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    command = json.loads(path.read_text())["plan_command"]
    assert command == f"commsched plan --profile {_profile(tmp_path)} --cluster 2x4 --intra 100gbit --inter 1gbit " \
                      "--json plan.json"
    assert "with the topology planner's plan" in printed and command in printed
    # one node: the algorithm is the flat ring's, no plan to name
    flat = advise(prof, Topology.described("1x8", "100gbit", "1gbit"))
    assert flat["planned"] is None and two_level_plan(prof, Topology.described("1x8", "100gbit", "1gbit")) is None
    assert not any("earliest-due-date plan" in r for r in flat["reasons"])


def _small_tensors(submit_s: float) -> Profile:
    """40 layers of 256 KiB gradients, each submitted task costing the training thread ``submit_s``."""
    layers = tuple(LayerProfile(f"l{i}", 0.002, 0.004, (TensorSpec(f"l{i}.w", (256 << 10) // 4),), apply_s=0.0001)
                   for i in range(40))
    return Profile(layers=layers, per_grad_hook_s=20e-6, per_task_submit_s=submit_s)


def test_advise_recommends_ddps_shape_where_communication_is_free_and_each_launch_costs():
    fast = Topology.emulated(2, None, "100gbit")
    out = advise(_small_tensors(2e-3), fast)  # 40 launches of 2 ms against one 25 MiB collective
    assert out["settings"] == {"ordering": "fifo", "cross_iteration": False, "fusion_bytes": 25 * MB}, out
    assert out["kept_default"] is False and out["helps"] is False  # DDP's shape: nothing to schedule
    assert any("DDP's own shape" in r and "synchronous" in r for r in out["reasons"])
    # a user already on DDP's shape: their default is simulated on the synchronous path, and kept
    same = advise(_small_tensors(2e-3), fast, default=out["settings"])
    assert same["default"]["settings"] == out["settings"] and same["kept_default"] is True
    assert same["default"]["step_s"] == pytest.approx(out["commsched_step_s"])
    # without the launch cost nothing separates them by more than the model's error: the default stays
    cheap = advise(_small_tensors(0.0), fast)
    assert cheap["settings"].get("cross_iteration", True) is True and cheap["kept_default"] is True
    # where the link is slow the pieces must overlap the backward: never the synchronous path
    slow = advise(_small_tensors(2e-3), Topology.emulated(2, None, "200mbit"))
    assert slow["settings"].get("cross_iteration", True) is True
    assert slow["default"]["step_s"] > out["commsched_step_s"]


def test_the_tuner_starts_from_ddps_shape_where_the_model_advises_it():
    from commsched.tuner import DDP_BUCKET_BYTES, Settings, model_starts

    found = model_starts(_small_tensors(2e-3), Topology.emulated(2, None, "100gbit"), 256 << 10,
                         plan_time_limit_s=1.0)
    advised = next(s for s in found.starts if s.ordering != "planned")
    assert advised == Settings("fifo", advised.partition_bytes, advised.credit_bytes, DDP_BUCKET_BYTES,
                               cross_iteration=False), found.notes
    assert "synchronous" in found.notes[0]


def test_advise_names_the_tied_embedding_split_where_the_first_layer_is_large_and_ready_last():
    layers = (LayerProfile("wte", 0.001, 0.002, tensors=(TensorSpec("wte.weight", 6_000_000, 4),)),
              *(LayerProfile(f"block{i}", 0.01, 0.02, tensors=(TensorSpec(f"block{i}.w", 1_000_000, 4),))
                for i in range(4)))
    out = advise(Profile(layers=layers), Topology.emulated(2, None, "1gbit"))
    reason = next(r for r in out["reasons"] if "needed first, ready last" in r)
    assert "60%" in reason and "split_tied_embeddings=True" in reason


def test_kendall_tau_counts_concordant_pairs():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    with pytest.raises(ValueError):
        kendall_tau([1], [1, 2])


def test_resolved_pairs_are_those_every_round_orders_alike_and_count_the_model_s_misorders():
    from commsched.costmodel.cli import resolved_pairs
    rounds = {"ddp": [1.0, 1.1, 1.0], "ddp:4": [0.9, 1.0, 0.95], "fifo": [0.8, 1.2, 0.9], "dynamic": [0.5, 0.6, 0.55]}
    measured = {"ddp": 1.0, "ddp:4": 0.95, "fifo": 0.9, "dynamic": 0.55}
    # the model puts ddp:4 behind ddp (a pair every round orders the other way) and fifo last (fifo's rounds
    # cross ddp's and ddp:4's: those pairs are the run's noise, not the model's error)
    predicted = {"ddp": 0.9, "ddp:4": 1.0, "fifo": 1.1, "dynamic": 0.5}
    out = resolved_pairs(rounds, measured, predicted)
    assert out["pairs"] == 6
    assert sorted(map(tuple, out["resolved"])) == [("ddp", "ddp:4"), ("ddp", "dynamic"), ("ddp:4", "dynamic"),
                                                   ("fifo", "dynamic")]
    assert out["discordant"] == [["ddp", "ddp:4"]] and out["kendall_tau"] == pytest.approx((4 - 2) / 4)
    # plain tau counts the two unresolved pairs against the model as well: 3 of 6 pairs misordered
    assert kendall_tau(list(measured.values()), list(predicted.values())) == pytest.approx(0.0)
    # one round (or a strategy without rounds) cannot resolve anything
    assert resolved_pairs({s: v[:1] for s, v in rounds.items()}, measured, predicted) is None
    assert resolved_pairs({}, measured, predicted) is None
    # a median that disagrees with every round's order leaves the pair unresolved
    out = resolved_pairs({"a": [1.0, 1.0], "b": [2.0, 2.0]}, {"a": 3.0, "b": 2.0}, {"a": 1.0, "b": 2.0})
    assert out["resolved"] == [] and out["kendall_tau"] is None


def test_the_validation_grid_is_workloads_by_bandwidths_by_topologies():
    class A:
        workloads, bandwidths, topologies = "a,b", "1gbit,500mbit", "2,4x2"
    grid = _grid(A())
    assert len(grid) == 8 and {"workload": "b", "bandwidth": "500mbit", "workers": 4, "nodes": 2} in grid
    A.topologies = "4y2"
    with pytest.raises(ValueError, match="WORKERSxNODES"):
        _grid(A())


def test_the_seed_table_shows_seconds_for_70b_on_100gbit_and_what_its_claim_would_need(capsys):
    assert main(["simulate", "--seed-table", "--strategies", "ddp,dynamic", "--partition-mb", "64",
                 "--credit-mb", "256", "--sim-steps", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| as claimed")]
    assert len(rows) == 2 and all(float(r.split("|")[3]) > 10 for r in rows)  # seconds, not the claimed 185 ms
    assert "185.0 ms" in out and "1/" in out and "consistent: gpt-7b" in out


def _bench(directory, tag, times, spread=0.05, compute_s=None, rounds=None):
    directory.mkdir(exist_ok=True)
    results = [{"strategy": s, "status": "ok", "step_time_s": t, "step_time_p25_s": t * (1 - spread),
                "step_time_p75_s": t * (1 + spread),
                **({"rounds": [{"round": k + 1, "status": "ok", "step_time_s": x} for k, x in enumerate(rounds[s])]}
                   if rounds else {})} for s, t in times.items()]
    report = {"results": results, **({"baseline": {"compute_s": compute_s}} if compute_s else {})}
    (directory / f"bench-{tag}.json").write_text(json.dumps(report))


def test_a_profile_s_drift_is_today_s_baseline_against_its_own(tmp_path):
    prof = Profile.from_json(_profile(tmp_path))
    with_base = dataclasses.replace(prof, meta={**prof.meta, "bench_baseline": {"compute_s": 0.5}})
    assert with_base.drift(0.6) == pytest.approx(0.2) and with_base.drift(0.4) == pytest.approx(-0.2)
    assert with_base.drift(None) is None and with_base.drift(0.0) is None
    bare = dataclasses.replace(prof, meta={}, step_overhead_s=0.01)  # opt.profile(): its own compute
    assert bare.drift(1.0) == pytest.approx(1.0 / (bare.compute_s - 0.01) - 1)
    scaled = with_base.scaled(compute=1 + with_base.drift(0.6))
    assert scaled.compute_s == pytest.approx(with_base.compute_s * 1.2)


@pytest.mark.parametrize("rescale", [False, True], ids=["as_profiled", "rescaled"])
def test_validate_reports_the_machine_s_drift_since_the_profile_and_can_scale_the_profile_to_it(tmp_path, rescale):
    import argparse

    from commsched.costmodel.cli import _validate_one
    from commsched.costmodel.simulator import SimSettings, simulate
    prof = Profile.from_json(_profile(tmp_path))
    topo = Topology.emulated(2, None, "1gbit")
    # the bench's own baseline measured the compute 20 % slower than the profile's did
    prof = dataclasses.replace(prof, meta={**prof.meta, "bench_baseline": {"compute_s": 0.5}})
    _bench(tmp_path / "now", "w-1gbit-2x2", {"ddp": 1.0, "dynamic": 1.0}, compute_s=0.6)
    args = argparse.Namespace(out_dir=str(tmp_path / "now"), reuse=True, topology_source="emulated",
                              other_runs="", steps=4, warmup=1, partition_mb=1.0, credit_mb=4.0,
                              rescale_compute=rescale)
    row = _validate_one(args, {"workload": "w", "bandwidth": "1gbit", "workers": 2, "nodes": None}, "w-1gbit-2x2",
                        ["ddp", "dynamic"], SimSettings(), None, lambda *a, **k: prof, lambda what: None)
    assert row["profile_drift"] == pytest.approx(0.2) and row["compute_rescaled"] is rescale
    used = prof.scaled(compute=1.2) if rescale else prof
    for s in ("ddp", "dynamic"):
        assert row["predicted_s"][s] == pytest.approx(simulate(used, topo, s, SimSettings()).step_time_s, rel=1e-12)
    if rescale:  # a slower machine: a slower prediction
        assert row["predicted_s"]["ddp"] > simulate(prof, topo, "ddp", SimSettings()).step_time_s
    # a profile without the bench's baseline (opt.profile()): its layers and optimizer, no per-step overhead
    bare = dataclasses.replace(prof, meta={}, step_overhead_s=0.01)
    row = _validate_one(args, {"workload": "w", "bandwidth": "1gbit", "workers": 2, "nodes": None}, "w-1gbit-2x2",
                        ["ddp"], SimSettings(), None, lambda *a, **k: bare, lambda what: None)
    assert row["profile_drift"] == pytest.approx(0.6 / (bare.compute_s - 0.01) - 1)


def test_validate_reads_the_measured_spread_and_other_runs_of_the_same_configuration(tmp_path):
    import argparse

    from commsched.costmodel.cli import _pooled_summary, _validate_one
    from commsched.costmodel.simulator import SimSettings, simulate
    prof = Profile.from_json(_profile(tmp_path))
    cfg = {"workload": "w", "bandwidth": "1gbit", "workers": 2, "nodes": None}
    topo = Topology.emulated(2, None, "1gbit")
    strategies = ["ddp", "dynamic"]
    pred = {s: simulate(prof, topo, s, SimSettings()).step_time_s for s in strategies}
    # this run: ddp measured 10 % slower than predicted (outside its +-5 % spread), dynamic exactly;
    # the earlier run: ddp as predicted, dynamic 20 % slower
    _bench(tmp_path / "now", "w-1gbit-2x2", {"ddp": pred["ddp"] / 0.9, "dynamic": pred["dynamic"]})
    _bench(tmp_path / "before", "w-1gbit-2x2", {"ddp": pred["ddp"], "dynamic": pred["dynamic"] * 1.2})
    args = argparse.Namespace(out_dir=str(tmp_path / "now"), reuse=True, topology_source="emulated",
                              other_runs=str(tmp_path / "before"), steps=4, warmup=1, partition_mb=1.0,
                              credit_mb=4.0)
    row = _validate_one(args, cfg, "w-1gbit-2x2", strategies, SimSettings(), None,
                        lambda *a, **k: prof, lambda what: None)
    assert row["status"] == "ok" and row["error"]["ddp"] == pytest.approx(-0.1)
    assert row["resolved_pairs"] is None
    # with the rounds of the report: ddp slower than dynamic in each, and the model says so too
    _bench(tmp_path / "now", "w-1gbit-2x2", {"ddp": pred["ddp"] / 0.9, "dynamic": pred["dynamic"]},
           rounds={"ddp": [2.0, 2.1, 2.2], "dynamic": [1.0, 1.1, 1.2]})
    row = _validate_one(args, cfg, "w-1gbit-2x2", strategies, SimSettings(), None,
                        lambda *a, **k: prof, lambda what: None)
    concordant = pred["ddp"] > pred["dynamic"]
    assert row["resolved_pairs"]["resolved"] == [["ddp", "dynamic"]]
    assert row["resolved_pairs"]["discordant"] == ([] if concordant else [["ddp", "dynamic"]])
    assert row["predicted_within_measured_iqr"] == {"ddp": False, "dynamic": True}
    assert row["measured_iqr_relative"]["ddp"] == pytest.approx(0.1)
    assert row["run_to_run"]["ddp"] == [pytest.approx(-0.1)] and row["run_to_run"]["dynamic"] == [pytest.approx(0.2)]
    # the median of two runs is their mean
    assert row["error_vs_pooled"]["ddp"] == pytest.approx(pred["ddp"] / ((pred["ddp"] / 0.9 + pred["ddp"]) / 2) - 1)
    summary = _pooled_summary([row])
    assert summary["run_to_run_max_abs"] == pytest.approx(0.2)
    assert summary["run_to_run_mean_abs"] == pytest.approx(0.15)
    assert _pooled_summary([{"error": {}}]) == {}  # without other runs it adds nothing


def test_validate_refuses_another_run_that_is_not_a_directory(tmp_path, capsys):
    rc = main(["validate", "--other-runs", str(tmp_path / "missing"), "--json", str(tmp_path / "v.json")])
    assert rc == 2 and "--other-runs" in capsys.readouterr().err


def test_validate_benches_with_rounds_and_refuses_fewer_than_one(tmp_path, capsys, monkeypatch):
    import argparse

    from commsched.costmodel import cli as cost_cli
    from commsched.costmodel.simulator import SimSettings
    rc = main(["validate", "--rounds", "0", "--json", str(tmp_path / "v.json")])
    assert rc == 2 and "--rounds must be >= 1" in capsys.readouterr().err
    prof = Profile.from_json(_profile(tmp_path))
    seen = []

    def fake_bench(cmd, **kwargs):  # what validate asked commsched bench for; answers with a report
        seen.append(cmd)
        _bench(tmp_path / "out", "w-1gbit-2x2", {"ddp": 0.5, "dynamic": 0.4})
        return argparse.Namespace(returncode=0)

    monkeypatch.setattr(cost_cli.subprocess, "run", fake_bench)
    (tmp_path / "out").mkdir()
    args = argparse.Namespace(out_dir=str(tmp_path / "out"), reuse=False, topology_source="emulated",
                              other_runs="", steps=4, warmup=1, rounds=3, partition_mb=1.0, credit_mb=4.0)
    row = cost_cli._validate_one(args, {"workload": "w", "bandwidth": "1gbit", "workers": 2, "nodes": None},
                                 "w-1gbit-2x2", ["ddp", "dynamic"], SimSettings(), None,
                                 lambda *a, **k: prof, lambda what: None)
    assert row["status"] == "ok" and row["measured_s"] == {"ddp": 0.5, "dynamic": 0.4}
    assert row["resolved_pairs"] is None  # a report without rounds resolves no pair
    cmd = seen[0]
    assert cmd[cmd.index("--rounds") + 1] == "3" and cmd[cmd.index("--strategies") + 1] == "ddp,dynamic"
    assert "--max-steal" not in cmd  # not asked for: the bench's default, never run again
    args.max_steal = 0.05
    cost_cli._validate_one(args, {"workload": "w", "bandwidth": "1gbit", "workers": 2, "nodes": None},
                           "w-1gbit-2x2", ["ddp", "dynamic"], SimSettings(), None, lambda *a, **k: prof,
                           lambda what: None)
    assert seen[1][seen[1].index("--max-steal") + 1] == "0.05"
    rc = main(["validate", "--max-steal", "1.5", "--json", str(tmp_path / "v.json")])
    assert rc == 2 and "--max-steal is a share of the machine's CPU" in capsys.readouterr().err
