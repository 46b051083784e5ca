"""``commsched bench --rounds``: interleaved repeats, the median of rounds, speedups paired within a round.

Synthetic phases for the arithmetic, a stand-in worker for the runner's order (no framework needed).
"""

from __future__ import annotations

import io
import json
import textwrap

import pytest

from commsched.bench.cpu import CpuTimes, steal_fraction
from commsched.bench.netns import LoopbackCluster
from commsched.bench.report import ROUND_KEYS, RESULT_KEYS, build_report, markdown
from commsched.bench.runner import PhaseResult, RunConfig, Runner, round_order
from commsched.bench.spec import parse_strategies

from bench_phases import CONFIG, DDP, baseline_rank as _baseline_rank, train_rank as _train_rank

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6])
def test_over_count_rounds_every_strategy_runs_once_in_every_position(count):
    orders = [round_order(count, r) for r in range(count)]
    for order in orders:
        assert sorted(order) == list(range(count))
    for position in range(count):
        assert sorted(order[position] for order in orders) == list(range(count))
    period = count if count % 2 == 0 else 2 * count
    assert round_order(count, period) == round_order(count, 0)  # the cycle repeats
    assert round_order(0, 3) == []


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
def test_every_strategy_follows_every_other_equally_often_over_a_period(count):
    # a plain rotation would run strategy i + 1 right after i in every round
    period = count if count % 2 == 0 else 2 * count
    follows = {}
    for r in range(period):
        order = round_order(count, r)
        assert sorted(order) == list(range(count))
        for a, b in zip(order, order[1:], strict=False):
            follows[(a, b)] = follows.get((a, b), 0) + 1
    pairs = [(a, b) for a in range(count) for b in range(count) if a != b]
    assert sorted(follows) == sorted(pairs)
    assert len(set(follows.values())) == 1, follows
    # the three rounds a run usually has: the two orders of a pair both occur among 5 strategies
    first3 = [round_order(5, r) for r in range(3)]
    assert any(o.index(2) < o.index(4) for o in first3) and any(o.index(4) < o.index(2) for o in first3)


def _phase(name, steps, rnd, position=0, status="ok"):
    if status != "ok":
        return PhaseResult(name, status, reason="worker 1 died", round=rnd, position=position)
    ranks = [_train_rank(list(steps), DDP), _train_rank(list(steps), DDP)]
    return PhaseResult(name, "ok", ranks, round=rnd, position=position)


def _report(phases):
    baseline = PhaseResult("baseline", "ok", [_baseline_rank(0), _baseline_rank(1)])
    return build_report(CONFIG, "netns", "note", {"name": "tiny"}, baseline, phases)


def test_the_median_of_rounds_and_a_speedup_paired_within_each_round():
    # Round 2 ran on a slow machine: both strategies 50 % slower there. The ratio of medians
    # would still be fine here, but the paired ratio is what cancels a slow round exactly.
    ddp = [_phase("ddp", [1.0] * 4, 0), _phase("ddp", [1.5] * 4, 1, 1), _phase("ddp", [1.0] * 4, 2, 1)]
    fast = [_phase("fast", [0.8] * 4, 0, 1), _phase("fast", [1.2] * 4, 1), _phase("fast", [0.82] * 4, 2)]
    report = _report([ddp, fast])
    d, f = report["results"]
    assert list(f) == list(RESULT_KEYS)
    assert d["step_time_s"] == pytest.approx(1.0) and f["step_time_s"] == pytest.approx(0.82)
    assert [x["speedup_vs_baseline"] for x in f["rounds"]] == pytest.approx([1.25, 1.25, 1.0 / 0.82])
    assert f["speedup_vs_baseline"] == pytest.approx(1.25)  # the median of the paired ratios
    assert d["speedup_vs_baseline"] == pytest.approx(1.0)
    for x in f["rounds"]:
        assert list(x) == list(ROUND_KEYS)
    assert [(x["round"], x["position"]) for x in f["rounds"]] == [(1, 2), (2, 1), (3, 1)]
    # each round keeps rank 0's measured steps in order (a slow first step after a switch shows as itself)
    assert [x["step_times_s"] for x in f["rounds"]] == [[0.8] * 4, [1.2] * 4, [0.82] * 4]
    # quantiles pool every round's steps; the throughput and efficiency follow the median of rounds
    assert f["measured_steps"] == 12
    assert (f["step_time_p25_s"], f["step_time_p75_s"]) == pytest.approx((0.8, 1.2))
    assert f["throughput_samples_s"] == pytest.approx(16 / 0.82)
    assert f["efficiency"] == pytest.approx(report["baseline"]["lower_bound_s"] / 0.82)
    text = markdown(report)
    assert "Per round" in text and "| fast | 0.800 (1.25x, #2) | 1.200 (1.25x, #1)" in text


def _planned(steps, rnd, digest, predicted, drift=None, engine=None):
    phase = _phase("planned", steps, rnd)
    plan = {"path": "/gone/plan.json", "digest": digest, "predicted": {"step_time_s": predicted}, "groups": 7,
            "pieces": 30, "credit_bytes": 2 << 20, "algorithms": ["ring"], "order": "fixed", "plan_s": 3.0,
            "plan": {"digest": digest, "pieces": []}, "profile_drift": drift, **(engine or {})}
    phase.ranks[0]["stats"] = {"plan_file": plan}
    return phase


def test_each_planned_round_keeps_the_plan_it_ran():
    # Round 2 ran another plan (the solver's time limit) and was slow: the report must show it.
    ddp = [_phase("ddp", [1.0] * 4, r) for r in range(3)]
    planned = [_planned([0.8] * 4, 0, "a" * 64, 0.79, engine={"engine": "reducer", "bucket_bytes": 1 << 20}),
               _planned([1.3] * 4, 1, "b" * 64, 0.95), _planned([0.81] * 4, 2, "a" * 64, 0.79, drift=0.25)]
    report = _report([ddp, planned])
    p = report["results"][1]
    assert [x["plan"]["digest"][0] for x in p["rounds"]] == ["a", "b", "a"]
    assert p["rounds"][1]["plan"]["predicted_step_s"] == 0.95 and p["rounds"][0]["plan"]["groups"] == 7
    assert p["stats"]["plan_file"]["plan"]["digest"] == "a" * 64  # the representative round's whole plan
    assert report["results"][0]["rounds"][0]["plan"] is None
    text = markdown(report)
    assert "- planned round 2: plan bbbbbbbbbbbb, predicted 0.950 s, measured 1.300 s; 7 groups, 30 pieces, " \
           "credit 2.00 MiB, ring, fixed order\n" in text
    assert p["rounds"][0]["plan"]["engine"] == "reducer" and p["rounds"][2]["plan"]["engine"] is None
    assert "- planned round 1: plan aaaaaaaaaaaa, predicted 0.790 s, measured 0.800 s; 7 groups, 30 pieces, " \
           "credit 2.00 MiB, ring, fixed order, engine: DDP's reducer, buckets 1 MiB\n" in text
    # a plan made from a cached profile scaled to the run's own baseline says by how much
    assert p["rounds"][2]["plan"]["profile_drift"] == 0.25 and p["rounds"][0]["plan"]["profile_drift"] is None
    assert "- planned round 3: plan aaaaaaaaaaaa, predicted 0.790 s, measured 0.810 s; 7 groups, 30 pieces, " \
           "credit 2.00 MiB, ring, fixed order; profile scaled +25.0% to this run's compute" in text


def _auto(steps, rnd, kept, score, verdict, favoured=None, safe=None):
    phase = _phase("auto", steps, rnd)
    raced = favoured or safe
    phase.ranks[0]["stats"] = {"tuner": {"incumbent": kept.to_dict(), "incumbent_median_s": score, "samples": 20,
                                         "history": [{"verdict": "race"},
                                                     {"settings": kept.to_dict(), "median_s": score,
                                                      "spread_s": 0.01, "verdict": verdict,
                                                      "race_favoured": raced.to_dict() if raced else None}],
                                         "favoured": favoured.to_dict() if favoured else None}}
    return phase


def test_each_auto_round_keeps_what_its_tuner_kept_and_scored():
    # every round tunes afresh: the report says what each kept, so a slow round's choice shows
    from commsched.bench.report import ROUND_TUNER_KEYS
    from commsched.tuner import UNLIMITED_BYTES, Settings

    fifo = Settings("fifo", UNLIMITED_BYTES, UNLIMITED_BYTES, 256 << 10)
    dyn = Settings("dynamic", 1 << 20, 4 << 20, 256 << 10)
    ddp = [_phase("ddp", [1.0] * 4, r) for r in range(3)]
    reducer = Settings("reducer", UNLIMITED_BYTES, UNLIMITED_BYTES, 1 << 20, cross_iteration=False)
    auto = [_auto([0.9] * 4, 0, fifo, 0.88, "race: replaced"),
            _auto([1.1] * 4, 1, dyn, 0.95, "race: kept", safe=reducer),
            _auto([0.91] * 4, 2, fifo, 0.9, "race: kept", favoured=fifo)]
    report = _report([ddp, auto])
    a = report["results"][1]
    assert [list(x["tuner"]) for x in a["rounds"]] == [list(ROUND_TUNER_KEYS)] * 3
    assert [x["tuner"]["kept"] for x in a["rounds"]] == [fifo.describe(), dyn.describe(), fifo.describe()]
    assert report["results"][0]["rounds"][0]["tuner"] is None
    # every sample of each round, so a round that kept a slow setting shows why
    assert a["rounds"][1]["tuner"]["history"] == [[None, None, None, "race"],
                                                  [dyn.describe(), 0.95, 0.01, "race: kept"]]
    assert ("- auto round 2: dynamic partition=1MiB credit=4MiB fusion=256KiB, scored 0.950 s, measured 1.100 s; "
            "20 samples, last verdict race: kept") in markdown(report)
    assert [x["tuner"]["favoured"] for x in a["rounds"]] == [None, reducer.describe(), fifo.describe()]
    assert [x["tuner"]["favoured_by"] for x in a["rounds"]] == [None, "safe", "model"]
    assert f"verdict race: kept; the model's pick: {fifo.describe()}" in markdown(report)
    assert f"verdict race: kept; favoured as the safe choice: {reducer.describe()}" in markdown(report)


def test_a_failed_round_is_listed_warned_and_left_out_of_the_figures():
    ddp = [_phase("ddp", [1.0] * 4, 0), _phase("ddp", [1.0] * 4, 1)]
    flaky = [_phase("flaky", [0.5] * 4, 0), _phase("flaky", [], 1, status="failed")]
    report = _report([ddp, flaky])
    f = report["results"][1]
    assert f["status"] == "ok" and f["step_time_s"] == pytest.approx(0.5)
    assert [x["status"] for x in f["rounds"]] == ["ok", "failed"]
    assert f["speedup_vs_baseline"] == pytest.approx(2.0)
    assert any("flaky: 1 of 2 rounds failed: worker 1 died" in w for w in report["warnings"])
    allfail = _report([ddp, [_phase("x", [], 0, status="failed"), _phase("x", [], 1, status="failed")]])
    assert allfail["results"][1]["status"] == "failed" and len(allfail["results"][1]["rounds"]) == 2


def test_without_rounds_the_entry_has_none_and_the_plain_ratio():
    report = _report([_phase("ddp", [1.0] * 4, 0), _phase("fast", [0.5] * 4, 0)])
    assert report["results"][1]["rounds"] is None
    assert report["results"][1]["speedup_vs_baseline"] == pytest.approx(2.0)
    assert "Per round" not in markdown(report)


def test_steal_is_the_share_of_cpu_time_given_to_other_guests():
    assert steal_fraction(CpuTimes(busy=0, total=0, steal=0), CpuTimes(busy=50, total=100, steal=10)) == 0.1
    assert steal_fraction(CpuTimes(1, 5, 0), CpuTimes(1, 5, 0)) is None


# What every stand-in worker does first: read its spec (``spec``) and rank (``a.rank``) as the runner passes them.
_READ_SPEC = textwrap.dedent("""
    import argparse, json, os
    p = argparse.ArgumentParser()
    p.add_argument("--spec"); p.add_argument("--rank", type=int)
    a = p.parse_args()
    spec = json.load(open(a.spec))
""")

# A stand-in worker: records which strategy ran, in which order, and reports one step time.
_WORKER = _READ_SPEC + textwrap.dedent("""
    with open(os.path.join(os.path.dirname(spec["run_dir"]), "order.txt"), "a") as f:
        f.write(f"{spec['strategy']}\\n")
    with open(os.path.join(os.path.dirname(spec["run_dir"]), "baseline.txt"), "a") as f:
        f.write(f"{spec['baseline_compute_s']}\\n")
    with open(os.path.join(spec["run_dir"], f"rank{a.rank}.json"), "w") as f:
        json.dump({"ok": True, "strategy": spec["strategy"]}, f)
""")


def _fake_runner(tmp_path, monkeypatch, module, source, strategies, workers=1, unavailable=None, **config):
    """A Runner on ``workers`` loopback nodes whose worker is the stand-in ``source`` (module ``module``);
    returns it, its work directory and its log."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    config = RunConfig(workload="tiny", workers=workers, nodes=workers, bandwidth=None, intra_bandwidth=None,
                       strategies=parse_strategies(strategies), steps=config.pop("steps", 1), warmup=0,
                       batch_size=1, partition_bytes=1 << 20, credit_bytes=4 << 20, network="loopback",
                       phase_timeout_s=60, **config)
    work = tmp_path / "work"
    work.mkdir()
    log = io.StringIO()
    runner = Runner(config, LoopbackCluster(workers), str(work), worker_module=module, log=log,
                    **({} if unavailable is None else {"unavailable": unavailable}))
    return runner, work, log


def test_the_runner_interleaves_rounds_in_rotated_order(tmp_path, monkeypatch):
    runner, work, log = _fake_runner(tmp_path, monkeypatch, "fake_rounds_worker", _WORKER, "ddp,fifo,dynamic",
                                     unavailable=lambda spec: "not here" if spec.name == "fifo" else None, rounds=2)
    assert runner.total_phases == 1 + 3 * 2
    baseline, phases = runner.run_all()
    assert baseline.status == "ok"
    # fifo is skipped each round without a launch; the others ran ddp, dynamic | dynamic, ddp
    assert (work / "order.txt").read_text().split() == ["None", "ddp", "dynamic", "dynamic", "ddp"]
    assert [[(p.name, p.status, p.round, p.position) for p in per] for per in phases] == [
        [("ddp", "ok", 0, 0), ("ddp", "ok", 1, 2)],
        [("fifo", "skipped", 0, 1), ("fifo", "skipped", 1, 0)],
        [("dynamic", "ok", 0, 2), ("dynamic", "ok", 1, 1)]]
    assert "[7/7] ddp (round 2/2): done" in log.getvalue()
    assert "[3/7] fifo (round 1/2): skipped: not here" in log.getvalue()


_STEAL_WORKER = _READ_SPEC + textwrap.dedent("""
    work = os.path.dirname(spec["run_dir"])
    with open(os.path.join(work, "order.txt"), "a") as f:
        f.write(f"{spec['strategy']}\\n")
    steals = json.load(open(os.path.join(work, "steals.json")))  # per strategy, one value a run, in order
    steal = steals.get(str(spec["strategy"]), [0.0]).pop(0) if steals.get(str(spec["strategy"])) else 0.0
    json.dump(steals, open(os.path.join(work, "steals.json"), "w"))
    cpu = {"cpu_busy": 0.5, "cpu_steal": steal, "process_cpu_s": 1.0, "wall_s": 1.0}
    with open(os.path.join(spec["run_dir"], f"rank{a.rank}.json"), "w") as f:
        json.dump({"ok": True, "strategy": spec["strategy"], "cpu": cpu, "steal": steal}, f)
""")


def _steal_run(tmp_path, monkeypatch, steals, **config):
    (tmp_path / "fake_steal_worker.py").write_text(_STEAL_WORKER)
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "steals.json").write_text(json.dumps(steals))
    log = io.StringIO()
    runner = Runner(RunConfig(workload="tiny", workers=1, nodes=1, bandwidth=None, intra_bandwidth=None,
                              strategies=parse_strategies("ddp,fifo"), steps=1, warmup=0, batch_size=1,
                              partition_bytes=1 << 20, credit_bytes=4 << 20, network="loopback",
                              phase_timeout_s=60, **config),
                    LoopbackCluster(1), str(work), worker_module="fake_steal_worker", log=log)
    baseline, phases = runner.run_all()
    return runner, [per[0] for per in phases], (work / "order.txt").read_text().split(), log.getvalue()


def test_a_phase_the_hypervisor_took_cpu_from_runs_again_and_the_least_stolen_run_is_kept(tmp_path, monkeypatch):
    # ddp: stolen once, then clean; fifo: stolen in every run (1 + 2 retries), the 10 % run kept
    runner, (ddp, fifo), order, log = _steal_run(
        tmp_path, monkeypatch, {"ddp": [0.2, 0.01], "fifo": [0.3, 0.1, 0.2, 0.0]}, max_steal=0.05, steal_retries=2)
    assert order == ["None", "ddp", "ddp", "fifo", "fifo", "fifo"]  # fifo's fourth value never ran
    assert (ddp.status, ddp.ranks[0]["steal"], ddp.discarded_steal) == ("ok", 0.01, [0.2])
    assert (fifo.status, fifo.ranks[0]["steal"], fifo.discarded_steal) == ("ok", 0.1, [0.3, 0.2])
    assert runner.total_phases == 6  # 1 + 2 planned, 3 more runs
    assert "ddp: the hypervisor took 20.0% of the CPU (--max-steal 5%): running it again" in log
    assert "fifo: every run lost more than 5% of the CPU to the hypervisor; kept the one that lost 10.0%" in log
    assert len(list((tmp_path / "work").glob("*_fifo"))) == 3  # each run in a directory of its own
    # without --max-steal nothing runs twice, whatever the steal
    again = tmp_path / "again"
    again.mkdir()
    _, (ddp, fifo), order, _ = _steal_run(again, monkeypatch, {"ddp": [0.9], "fifo": [0.9]})
    assert order == ["None", "ddp", "fifo"] and ddp.discarded_steal == [] and fifo.discarded_steal == []


def test_the_report_lists_the_runs_discarded_for_steal_per_round_and_per_strategy():
    ddp = [_phase("ddp", [1.0] * 4, r) for r in range(2)]
    fifo = [_phase("fifo", [0.9] * 4, 0), _phase("fifo", [0.9] * 4, 1, 1)]
    fifo[1].discarded_steal = [0.25, 0.125]
    report = _report([ddp, fifo])
    d, f = report["results"]
    assert [x["rerun_steal"] for x in f["rounds"]] == [None, [0.25, 0.125]] and f["rerun_steal"] == [0.25, 0.125]
    assert d["rerun_steal"] is None and [x["rerun_steal"] for x in d["rounds"]] == [None, None]
    assert "- fifo round 2: 0.250, 0.125 discarded; kept" in markdown(report)
    single = _phase("fifo", [0.9] * 4, 0)
    single.discarded_steal = [0.5]
    plain = _report([_phase("ddp", [1.0] * 4, 0), single])  # one round: the warning says it
    assert plain["results"][1]["rerun_steal"] == [0.5] and plain["results"][1]["rounds"] is None
    assert any("fifo: run again because the hypervisor took CPU" in w and "50.0%" in w for w in plain["warnings"])


@pytest.mark.parametrize("field, value, message", [("max_steal", 1.5, "max_steal is a share"),
                                                  ("max_steal", -0.1, "max_steal is a share"),
                                                  ("steal_retries", -1, "steal_retries must be >= 0")])
def test_bad_steal_settings_are_refused_naming_them(field, value, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(workload="tiny", workers=1, nodes=1, bandwidth=None, intra_bandwidth=None, strategies=[],
                  steps=1, warmup=0, batch_size=1, partition_bytes=1, credit_bytes=1, network="loopback",
                  **{field: value})


def test_every_strategy_phase_is_told_the_baseline_s_compute(tmp_path, monkeypatch):
    """What ``planned`` scales a cached profile to (Profile.drift): the baseline phase's compute, given
    to every later phase's spec; None where the baseline's results do not have it."""
    from commsched.bench import runner as bench_runner

    (tmp_path / "fake_rounds_worker.py").write_text(_WORKER)
    monkeypatch.chdir(tmp_path)
    config = RunConfig(workload="tiny", workers=1, nodes=1, bandwidth=None, intra_bandwidth=None,
                       strategies=parse_strategies("ddp,planned"), steps=1, warmup=0, batch_size=1,
                       partition_bytes=1 << 20, credit_bytes=4 << 20, network="loopback", phase_timeout_s=60)
    for summary, expected in (({"compute_s": 0.25}, "0.25"), (None, "None")):
        def summarize(ranks, summary=summary):
            if summary is None:
                raise KeyError("forward_s")  # a worker that reports no baseline figures
            return summary
        monkeypatch.setattr(bench_runner, "summarize_baseline", summarize)
        work = tmp_path / f"work-{expected}"
        work.mkdir()
        runner = Runner(config, LoopbackCluster(1), str(work), worker_module="fake_rounds_worker", log=io.StringIO())
        runner.run_all()
        # the baseline itself ran before it was known; ddp and planned after
        assert (work / "baseline.txt").read_text().split() == ["None", expected, expected]
        assert runner.baseline_compute_s == (0.25 if summary else None)


_INTERLEAVE_WORKER = _READ_SPEC + textwrap.dedent("""
    with open(os.path.join(os.path.dirname(spec["run_dir"]), "launches.txt"), "a") as f:
        f.write(f"{spec['mode']}:{','.join(spec['strategies'] or [])}\\n")
    out = {"ok": True}
    if spec["mode"] == "interleave":
        # "static" stands for a strategy the worker cannot build; the others run spec["blocks"] blocks,
        # each block's step a hundredth of a second per position, so the split is visible
        live = [n for n in spec["strategies"] if n != "static"]
        out = {"interleaved": {"static": {"skipped": "no plan here"}}}
        for i, name in enumerate(live):
            out["interleaved"][name] = [{"step_times_s": [1.0 + i + b / 100] * spec["steps"],
                                         "position": (i + b) % len(live)} for b in range(spec["blocks"])]
    with open(os.path.join(spec["run_dir"], f"rank{a.rank}.json"), "w") as f:
        json.dump(out, f)
""")


def test_interleave_runs_every_strategy_in_one_phase_and_reports_each_block_as_a_round(tmp_path, monkeypatch):
    runner, work, log = _fake_runner(tmp_path, monkeypatch, "fake_interleave_worker", _INTERLEAVE_WORKER,
                                     "ddp,fifo,dynamic,static", workers=2, steps=2, interleave=3,
                                     unavailable=lambda spec: "not here" if spec.name == "fifo" else None)
    assert runner.total_phases == 2  # the baseline and one interleaved phase
    seen = []
    baseline, phases = runner.run_all(on_phase=seen.append)
    assert baseline.status == "ok"
    # one launch per rank for all strategies; fifo, unavailable here, is not sent to the workers
    assert (work / "launches.txt").read_text().split() == ["baseline:", "baseline:", "interleave:ddp,dynamic,static",
                                                           "interleave:ddp,dynamic,static"]
    assert [[(p.name, p.status, p.round, p.position) for p in per] for per in phases] == [
        [("ddp", "ok", 0, 0), ("ddp", "ok", 1, 1), ("ddp", "ok", 2, 0)],
        [("fifo", "skipped", 0, 0)],
        [("dynamic", "ok", 0, 1), ("dynamic", "ok", 1, 0), ("dynamic", "ok", 2, 1)],
        [("static", "skipped", 0, 0)]]
    assert phases[3][0].reason == "no plan here"
    # each block's ranks are that block's results, one per rank
    assert [p.ranks[1]["step_times_s"] for p in phases[2]] == [[2.0, 2.0], [2.01, 2.01], [2.02, 2.02]]
    assert len(seen) == 3 + 1 + 3 + 1
    assert "fifo: skipped: not here" in log.getvalue() and "interleaved: done" in log.getvalue()


def test_an_interleaved_phase_may_take_the_timeout_of_every_strategy_in_it(tmp_path, monkeypatch):
    """``--timeout`` is what one strategy's phase may take; the interleaved phase holds them all."""
    from commsched.bench import runner as bench_runner

    runner, _, _ = _fake_runner(tmp_path, monkeypatch, "fake_interleave_worker", _INTERLEAVE_WORKER,
                                "ddp,dynamic,static", interleave=2)
    waits = []
    wait = bench_runner.WorkerGroup.wait

    def timed_wait(group, timeout, *args, **kwargs):
        waits.append(timeout)
        return wait(group, timeout, *args, **kwargs)

    monkeypatch.setattr(bench_runner.WorkerGroup, "wait", timed_wait)
    runner.run_all()
    assert waits == [60, 3 * 60]  # the baseline, then the three strategies' phase


def test_an_interleaved_phase_that_fails_fails_every_strategy_in_it(tmp_path, monkeypatch):
    runner, _, _ = _fake_runner(tmp_path, monkeypatch, "fake_failing_worker",
                                "import json, sys\nspec = json.load(open(sys.argv[2]))\n"
                                "sys.exit(3 if spec['mode'] == 'interleave' else 0)\n", "ddp,dynamic", interleave=2)
    _, phases = runner.run_all()
    assert [[(p.name, p.status) for p in per] for per in phases] == [[("ddp", "failed")], [("dynamic", "failed")]]
    assert all(per[0].reason for per in phases)


@pytest.mark.parametrize("settings, message", [
    ({"interleave": 1}, "--interleave is the number of blocks"),
    ({"interleave": -2}, "--interleave is the number of blocks"),
    ({"interleave": 4, "rounds": 3}, "give one"),
    ({"interleave": 4, "max_steal": 0.05}, "--max-steal runs a phase again"),
    ({"interleave": 4, "timeline_dir": "t"}, "run the strategy alone with --timeline"),
    ({"interleave": 4, "strategies": "ddp,horovod"}, "horovod cannot share a worker process"),
])
def test_an_interleaved_run_that_cannot_be_one_is_refused_naming_the_flag(settings, message):
    settings = {"strategies": "ddp,dynamic", **settings}
    settings["strategies"] = parse_strategies(settings["strategies"])
    with pytest.raises(ValueError, match=message):
        RunConfig(workload="tiny", workers=1, nodes=1, bandwidth=None, intra_bandwidth=None, steps=1, warmup=0,
                  batch_size=1, partition_bytes=1, credit_bytes=1, network="loopback", **settings)


def test_rounds_below_one_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        RunConfig(workload="tiny", workers=1, nodes=1, bandwidth=None, intra_bandwidth=None, strategies=[],
                  steps=1, warmup=0, batch_size=1, partition_bytes=1, credit_bytes=1, network="loopback", rounds=0)


def test_paired_ratios_against_the_best_peer_are_read_per_round(tmp_path, capsys):
    from commsched.bench import paired

    ddp = [_phase("ddp", [1.0] * 4, 0), _phase("ddp", [1.2] * 4, 1), _phase("ddp", [1.0] * 4, 2)]
    ddp1 = [_phase("ddp:1", [0.8] * 4, 0), _phase("ddp:1", [1.3] * 4, 1), _phase("ddp:1", [0.9] * 4, 2)]
    ours = [_phase("fifo", [0.88] * 4, 0), _phase("fifo", [1.2] * 4, 1), _phase("fifo", [0.9] * 4, 2)]
    report = _report([ddp, ddp1, ours])
    result = paired.paired(report, ("ddp", "ddp:1"))
    assert result["best_peer"] == "ddp:1"  # median of rounds 0.9 against ddp's 1.0
    fifo = result["strategies"]["fifo"]
    assert fifo["vs_best_peer_rounds"] == pytest.approx([0.8 / 0.88, 1.3 / 1.2, 1.0])
    assert fifo["vs_best_peer"] == pytest.approx(1.0)
    # the fastest peer of each round: 0.8, 1.2 (ddp), 0.9
    assert fifo["vs_fastest_peer_each_round"] == pytest.approx(1.0)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert paired.main([str(path), "--peers", "ddp,ddp:1"]) == 0
    assert "fifo: 1.000x ddp:1" in capsys.readouterr().out
    assert paired.main([str(path), "--peers", "horovod"]) == 2
    assert "none of the peers horovod ran" in capsys.readouterr().err
    path.write_text(json.dumps(_report([_phase("ddp", [1.0] * 4, 0)])))
    assert paired.main([str(path)]) == 2 and "--rounds 3" in capsys.readouterr().err


def test_paired_marks_the_rounds_the_hypervisor_took_cpu_from_the_strategy_or_the_best_peer(tmp_path, capsys):
    from commsched.bench import paired

    ddp = [_phase("ddp", [1.0] * 4, r) for r in range(3)]
    ours = [_phase("fifo", [0.9] * 4, 0), _phase("fifo", [1.4] * 4, 1), _phase("fifo", [0.95] * 4, 2)]
    report = _report([ddp, ours])
    steal = {("ddp", 1): 0.01, ("ddp", 2): 0.0, ("ddp", 3): 0.06,  # round 3: the peer's CPU was taken
             ("fifo", 1): None, ("fifo", 2): 0.125, ("fifo", 3): 0.0}  # round 2: ours (None: not measured)
    for e in report["results"]:
        for x in e["rounds"]:
            x["cpu_steal"] = steal[(e["strategy"], x["round"])]
    fifo = paired.paired(report, ("ddp",))["strategies"]["fifo"]
    assert fifo["round_numbers"] == [1, 2, 3] and fifo["stolen_rounds"] == [2, 3]
    assert fifo["vs_best_peer_rounds"] == pytest.approx([1 / 0.9, 1 / 1.4, 1 / 0.95])  # kept, only marked
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert paired.main([str(path), "--peers", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "(rounds 1.111, 0.714*, 1.053*)" in out and "took more than 5% of the CPU" in out
    for e in report["results"]:
        for x in e["rounds"]:
            x["cpu_steal"] = 0.05  # at the bar, not over it
    path.write_text(json.dumps(report))
    assert paired.main([str(path), "--peers", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "*" not in out and paired.paired(report, ("ddp",))["strategies"]["fifo"]["stolen_rounds"] == []


def test_paired_by_mean_reads_throughput_where_a_median_falls_in_one_cluster_of_steps():
    from commsched.bench.paired import paired

    # "spill" runs three quick steps and one slow one (the link's period spread unevenly over steps): its
    # median is a quick step, its mean the period; ddp is steady
    ddp = [_phase("ddp", [0.8] * 4, r) for r in range(3)]
    spill = [_phase("spill", [0.6, 0.6, 0.6, 1.5], r, 1) for r in range(3)]
    report = _report([ddp, spill])
    by_median = paired(report, ("ddp",))["strategies"]["spill"]
    by_mean = paired(report, ("ddp",), by="mean")
    assert by_median["vs_best_peer"] == pytest.approx(0.8 / 0.6)
    assert by_mean["by"] == "mean" and by_mean["strategies"]["spill"]["vs_best_peer"] == pytest.approx(0.8 / 0.825)
    with pytest.raises(ValueError, match="'median' or 'mean'"):
        paired(report, ("ddp",), by="p90")
    for x in report["results"][1]["rounds"]:
        x["step_times_s"] = None  # a report from before rounds kept their steps
    with pytest.raises(ValueError, match="'spill'.*no step_times_s.*by median"):
        paired(report, ("ddp",), by="mean")
    assert paired(report, ("ddp",))["strategies"]["spill"]["vs_best_peer"] == pytest.approx(0.8 / 0.6)


def test_paired_gives_a_bootstrap_interval_of_the_median_ratio_and_reads_a_target_against_it(tmp_path, capsys):
    from commsched.bench import paired

    assert paired.interval([1.0, 1.1, 0.9]) is None  # too few rounds to resample
    tight = [1.10, 1.11, 1.12, 1.09, 1.10, 1.11, 1.10, 1.12]
    wide = [0.80, 1.25, 0.95, 1.10, 0.85, 1.20, 1.00, 0.90]
    low, high = paired.interval(tight)
    assert 1.09 <= low <= paired.median(tight) <= high <= 1.12
    wlow, whigh = paired.interval(wide)
    assert whigh - wlow > 4 * (high - low)  # the host's noise widens it
    assert paired.interval(wide) == (wlow, whigh)  # seeded: the same report reads the same
    assert paired.verdict((low, high), 1.1, 1.05) == "met"
    assert paired.verdict((low, high), 1.1, 1.2) == "missed"
    assert paired.verdict((wlow, whigh), 1.0, 0.99) == "cannot tell"
    assert paired.verdict(None, 1.0, 0.99) == "met"  # no interval: the median alone
    # eight blocks of an interleaved run: the line gives the interval and the verdict
    ddp = [_phase("ddp", [1.0] * 4, r) for r in range(8)]
    ours = [_phase("fifo", [1.0 / v] * 4, r) for r, v in enumerate(wide)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report([ddp, ours])))
    assert paired.main([str(path), "--peers", "ddp", "--target", "0.99"]) == 0
    out = capsys.readouterr().out
    assert f"90% interval {wlow:.3f}-{whigh:.3f}" in out and ">= 0.99x: cannot tell" in out
    assert paired.main([str(path), "--peers", "ddp", "--target", "0.5"]) == 0
    assert ">= 0.5x: met" in capsys.readouterr().out
