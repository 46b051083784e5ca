"""Every framework's benchmark writes the same report keys and prints the same table.

torch goes through ``build_report`` (the runner's phases); TensorFlow and MXNet
through ``run_strategies`` (the MLP loop) with a launcher that writes what their
workers write. No framework is imported: the report code is the same for all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from commsched.bench import netns
from commsched.bench.cli import run_strategies
from commsched.bench.options import add_mlp_bench_arguments
from commsched.bench.report import (
    BASELINE_KEYS,
    CALIBRATION_KEYS,
    CONFIG_KEYS,
    REPORT_KEYS,
    RESULT_KEYS,
    ROUND_KEYS,
    TABLE_HEADER,
    WORKLOAD_KEYS,
    build_report,
    markdown,
)
from commsched.bench.runner import PhaseResult

@pytest.fixture(autouse=True)
def _run_dirs_under_tmp_path(tmp_path, monkeypatch):
    """The phases these tests fail on purpose keep their run directories for their logs, by design: under
    pytest's ``tmp_path`` (which pytest prunes), not in /tmp, where every CI run left a dozen."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))


#: What the plugins' ``workloads.describe()`` gives (importing a plugin package imports its framework).
MLP = {"name": "mlp", "description": "MLP 256-2x64-10, float32", "param_bytes": 4 * 21578, "num_params": 21578,
       "layers": None}

needs_root = pytest.mark.skipif(not netns.netns_available()[0],
                                reason=f"needs root and iproute2: {netns.netns_available()[1]}")


def _torch() -> dict:
    cpu = {"cpu_busy": 0.5, "process_cpu_s": 1.0, "wall_s": 2.0}
    base_rank = {"param_bytes": 1000, "num_params": 250, "layers": [], "forward_s": [0.2] * 3,
                 "backward_s": [0.4] * 3, "optimizer_s": [0.05] * 3, "one_worker_s": [0.6] * 3,
                 "comm_s": [0.5] * 3, "comm_cpu": cpu, "forward_under_comm_s": [0.25] * 3,
                 "backward_under_comm_s": [0.45] * 3, "optimizer_under_comm_s": [0.05] * 3,
                 "under_comm_span_s": [[0.75, 0.5]] * 3}

    def train(steps):
        return {"step_times_s": steps, "total_s": sum(steps), "forward_s": [0.2] * len(steps),
                "backward_s": [0.85] * len(steps), "step_call_s": [0.05] * len(steps), "bubble_s": None,
                "bubble_method": "backward() under DDP minus ...", "cpu": cpu, "checksum": "a",
                "stats": {}, "timeline": []}

    config = dict.fromkeys(CONFIG_KEYS)
    config.update(workload="tiny", workers=2, nodes=2, batch_size=8, bandwidth="1gbit", extra={})
    phases = [PhaseResult("ddp", "ok", [train([1.0, 1.1, 0.9]), train([1.0, 1.0, 1.0])]),
              PhaseResult("dynamic", "ok", [train([0.8, 0.8, 0.9]), train([0.8, 0.8, 0.8])]),
              PhaseResult("horovod", "skipped", reason="horovod is not installed")]
    return build_report(config, "netns", "note", {"name": "tiny", "description": "tiny"},
                        PhaseResult("baseline", "ok", [base_rank, base_rank]), phases)


def _mlp_args(tmp_path: Path, strategies: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_mlp_bench_arguments(parser, strategies=(), default_strategies="", layers=2, gradient_mb_hint="",
                            partition_mb=1.0, credit_mb=2.0)
    return parser.parse_args(["--network", "loopback", "--strategies", strategies, "--batch-size", "8",
                              "--json", str(tmp_path / "report.json")])


def _fake_launch(step_times: dict[str, list[float]]):
    """What the frameworks' workers write: step intervals, world, pieces (or a skip, or nothing)."""
    def launch(cluster, strategy: str, out: Path) -> str | None:
        if strategy == "horovod":
            (out / "rank0.json").write_text(json.dumps({"skipped": "import horovod.tensorflow fails"}))
            return None
        if strategy not in step_times:
            return "workers failed: rank 0 exited 1"
        world = 1 if strategy == "compute" else 2
        (out / "rank0.json").write_text(json.dumps({"step_times_s": step_times[strategy], "world": world,
                                                    "pieces_per_step": 7}))
        return None
    return launch


def _mlp(tmp_path: Path, capsys, framework: str, reference: str, extra_strategy: str) -> tuple[int, dict, str]:
    sub = tmp_path / framework
    sub.mkdir()
    strategies = ["compute", "comm", reference, "dynamic", extra_strategy]
    args = _mlp_args(sub, ",".join(strategies))
    times = {"compute": [0.3, 0.3, 0.4], "comm": [0.5, 0.6, 0.5], reference: [1.0, 1.2, 1.0],
             "dynamic": [0.8, 0.7, 0.8]}
    code = run_strategies(args, framework=framework, allowed=strategies, nodes=2, launch=_fake_launch(times),
                          workload=MLP, extra={"hidden": 64})
    return code, json.loads((sub / "report.json").read_text()), capsys.readouterr().out


def test_the_three_frameworks_write_the_same_keys_and_table_header(tmp_path, capsys):
    torch_report = _torch()
    torch_table = markdown(torch_report)
    tf_code, tf_report, tf_table = _mlp(tmp_path, capsys, "tensorflow", "mwms", "horovod")
    mx_code, mx_report, mx_table = _mlp(tmp_path, capsys, "mxnet", "dist_sync", "dynamic_server")
    assert tf_code == 0  # a skip is not a failure
    assert mx_code == 1  # dynamic_server failed
    reports = {"torch": torch_report, "tensorflow": tf_report, "mxnet": mx_report}
    for name, report in reports.items():
        assert list(report) == list(REPORT_KEYS), name
        assert report["framework"] == name and report["predicted"] is False
        assert list(report["config"]) == list(CONFIG_KEYS), name
        assert set(report["workload"]) == set(WORKLOAD_KEYS), name
        assert list(report["baseline"]) == list(BASELINE_KEYS), name
        for entry in report["results"]:
            assert list(entry) == list(RESULT_KEYS), (name, entry["strategy"])
    assert [r["baseline_strategy"] for r in reports.values()] == ["ddp", "mwms", "dist_sync"]
    assert list(torch_report["calibration"]) == list(CALIBRATION_KEYS)
    assert tf_report["calibration"] is None and mx_report["calibration"] is None
    for table in (torch_table, tf_table, mx_table):
        assert table.splitlines().count(TABLE_HEADER) == 1


def test_mlp_reports_take_median_iqr_speedup_and_bounds_from_the_step_times(tmp_path, capsys):
    _, report, table = _mlp(tmp_path, capsys, "mxnet", "dist_sync", "dynamic_server")
    rows = {r["strategy"]: r for r in report["results"]}
    ref, dyn = rows["dist_sync"], rows["dynamic"]
    assert ref["step_time_s"] == pytest.approx(1.0) and ref["step_time_iqr_s"] == pytest.approx(0.1)
    assert ref["speedup_vs_baseline"] == 1.0 and dyn["speedup_vs_baseline"] == pytest.approx(1.0 / 0.8)
    assert dyn["throughput_samples_s"] == pytest.approx(2 * 8 / 0.8)
    base = report["baseline"]
    assert (base["compute_s"], base["comm_s"]) == (pytest.approx(0.3), pytest.approx(0.5))
    assert base["lower_bound_s"] == pytest.approx(0.5) and base["no_overlap_s"] == pytest.approx(0.8)
    assert dyn["efficiency"] == pytest.approx(0.5 / 0.8)
    # no bubble from the MLP workers: exposed = step - compute = 0.5 of comm 0.5, nothing hidden
    assert dyn["overlap_ratio"] == pytest.approx(0.0) and dyn["exposed_comm_s"] == pytest.approx(0.5)
    failed = rows["dynamic_server"]
    assert failed["status"] == "failed" and "rank 0 exited 1" in failed["reason"] and failed["step_time_s"] is None
    assert "| dynamic_server | failed: workers failed: rank 0 exited 1 |" in table
    assert "speedups are relative to **dist_sync**" in table


def test_mlp_rounds_interleave_and_pair_each_round(tmp_path, capsys):
    """--rounds on an MLP benchmark: every strategy once a round in a Williams row, the median of
    the rounds' medians, speedups paired within a round, the baseline from the rounds, and a
    failed round listed and left out; the report feeds commsched.bench.paired."""
    from commsched.bench.paired import paired
    from commsched.bench.runner import round_order

    chosen = ["compute", "comm", "mwms", "horovod_like", "dynamic"]
    ran: list[str] = []
    # Round r slows every strategy by 1 + r/10: paired ratios see through it, pooled ones do not.
    per_round = {"compute": 0.3, "comm": 0.5, "mwms": 1.0, "horovod_like": 0.9, "dynamic": 0.8}

    def launch(cluster, strategy: str, out: Path) -> str | None:
        ran.append(strategy)
        rnd = sum(s == strategy for s in ran) - 1
        if strategy == "dynamic" and rnd == 1:
            return "workers failed: rank 1 exited 1"
        t = per_round[strategy] * (1 + rnd / 10)
        (out / "rank0.json").write_text(json.dumps({"step_times_s": [t, t, t], "world": 2,
                                                    "stats": {"round": rnd}}))
        return None

    args = _mlp_args(tmp_path, ",".join(chosen))
    args.rounds = 3
    code = run_strategies(args, framework="tensorflow", allowed=chosen, nodes=2, launch=launch, workload=MLP,
                          extra={})
    assert code == 0  # one failed round of three is listed, not a failed strategy
    assert ran == [chosen[i] for r in range(3) for i in round_order(5, r)]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["extra"]["rounds"] == 3
    rows = {r["strategy"]: r for r in report["results"]}
    for row in rows.values():
        assert list(row) == list(RESULT_KEYS)
        assert [x["round"] for x in row["rounds"]] == [1, 2, 3]
        assert all(list(x) == list(ROUND_KEYS) for x in row["rounds"])
    hv, dyn = rows["horovod_like"], rows["dynamic"]
    assert hv["step_time_s"] == pytest.approx(0.9 * 1.1) and hv["measured_steps"] == 9
    assert hv["stats"] == {"round": 1}  # the round nearest the median
    assert [x["position"] for x in hv["rounds"]] == [round_order(5, r).index(3) + 1 for r in range(3)]
    assert report["baseline"]["compute_s"] == pytest.approx(0.3 * 1.1)
    # compute and comm are the bound's parts: no efficiency, and no "beats the lower bound" warning
    assert rows["compute"]["efficiency"] is None and rows["comm"]["overlap_ratio"] is None
    assert not any("beats the lower bound" in w for w in report["warnings"])
    assert [x["status"] for x in dyn["rounds"]] == ["ok", "failed", "ok"]
    assert dyn["step_time_s"] == pytest.approx(0.8 * 1.1) and dyn["measured_steps"] == 6
    assert "1 of 3 rounds failed" in dyn["reason"] and any("rank 1 exited 1" in w for w in report["warnings"])
    assert dyn["speedup_vs_baseline"] == pytest.approx(1.0 / 0.8)  # paired with mwms round by round
    assert [x["speedup_vs_baseline"] for x in dyn["rounds"]] == [pytest.approx(1.25), None, pytest.approx(1.25)]
    result = paired(report, ["horovod_like", "mwms"])
    assert result["best_peer"] == "horovod_like"
    assert result["strategies"]["dynamic"]["vs_best_peer"] == pytest.approx(0.9 / 0.8)


def test_mlp_bench_deletes_the_run_directories_of_finished_phases_and_keeps_the_failed_ones(tmp_path, capsys):
    """Each phase runs in a fresh temporary directory: a phase that wrote its result (or skipped) leaves
    nothing behind (the suite ran ~36 a CI run and left them all in /tmp); a failed one keeps its logs,
    named in its report entry and on stderr."""
    runs: dict[str, Path] = {}
    times = {"compute": [0.3], "comm": [0.5], "dist_sync": [1.0]}
    inner = _fake_launch(times)

    def launch(cluster, strategy: str, out: Path) -> str | None:
        runs[strategy] = out
        (out / "worker0.log").write_text("log of " + strategy)
        return inner(cluster, strategy, out)

    args = _mlp_args(tmp_path, "compute,comm,dist_sync,horovod,dynamic")
    code = run_strategies(args, framework="mxnet", allowed=("compute", "comm", "dist_sync", "horovod", "dynamic"),
                          nodes=2, launch=launch, workload=MLP, extra={})
    assert code == 1  # dynamic failed
    assert {s: d.exists() for s, d in runs.items()} == {"compute": False, "comm": False, "dist_sync": False,
                                                         "horovod": False, "dynamic": True}
    assert (runs["dynamic"] / "worker0.log").read_text() == "log of dynamic"
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "report.json").read_text())["results"]}
    assert rows["dynamic"]["logs"] == str(runs["dynamic"])
    assert rows["dist_sync"]["logs"] is None and rows["horovod"]["logs"] is None
    assert f"logs kept in {runs['dynamic']}" in capsys.readouterr().err


def test_mlp_bench_refuses_fewer_than_one_round(tmp_path, capsys):
    args = _mlp_args(tmp_path, "dist_sync")
    args.rounds = 0
    code = run_strategies(args, framework="mxnet", allowed=("dist_sync",), nodes=2, launch=_fake_launch({}),
                          workload=MLP, extra={})
    assert code == 2 and "--rounds must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_mlp_bench_rejects_unknown_strategies_naming_the_allowed(tmp_path, capsys):
    args = _mlp_args(tmp_path, "dist_sync,nccl")
    code = run_strategies(args, framework="mxnet", allowed=("dist_sync", "dynamic"), nodes=2,
                          launch=_fake_launch({}), workload=MLP, extra={})
    assert code == 2
    assert "nccl" in capsys.readouterr().err and not (tmp_path / "report.json").exists()


_SIGTERM_SCRIPT = textwrap.dedent("""
    import argparse, subprocess, sys, time
    from commsched.bench.cli import run_strategies
    from commsched.bench.options import add_mlp_bench_arguments

    parser = argparse.ArgumentParser()
    add_mlp_bench_arguments(parser, strategies=(), default_strategies="", layers=1, gradient_mb_hint="",
                            partition_mb=1.0, credit_mb=1.0)
    args = parser.parse_args(["--strategies", "dist_sync", "--json", sys.argv[1]])

    def launch(cluster, strategy, out):
        sleeper = subprocess.Popen(cluster.nodes[1].wrap(["sh", "-c", "echo; exec sleep 60"]),
                                   stdout=subprocess.PIPE)
        sleeper.stdout.readline()  # inside its namespace now
        print(cluster.prefix, sleeper.pid, flush=True)
        try:
            time.sleep(60)
        finally:
            sleeper.kill()
            sleeper.wait()

    sys.exit(run_strategies(args, framework="mxnet", allowed=("dist_sync",), nodes=3, launch=launch,
                            workload={"name": "mlp"}, extra={}))
""")


@needs_root
def test_sigterm_during_an_mlp_bench_removes_its_namespaces(tmp_path):
    """The MXNet bench used to leave its namespaces behind on SIGTERM; its loop is now the shared one."""
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path / "r.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        prefix, _sleeper = proc.stdout.readline().split()
        assert [ns for ns in netns.list_namespaces() if ns.startswith(prefix)]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, proc.stderr.read()
    assert [ns for ns in netns.list_namespaces() if ns.startswith(prefix)] == []
    assert not os.path.exists(tmp_path / "r.json")
