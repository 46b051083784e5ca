"""End-to-end ``python -m commsched.plugins.torch.bench`` runs on the tiny workload.

They check the report's structure and invariants (schema, one entry per
strategy, ranks ending with identical parameters, cleanup), never speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from commsched.bench import netns  # noqa: E402
from commsched.bench.report import RESULT_KEYS, SCHEMA  # noqa: E402

needs_root = pytest.mark.skipif(not netns.netns_available()[0],
                                reason=f"needs root: {netns.netns_available()[1]}")

ENTRY_KEYS = {"strategy", "status", "step_time_s", "speedup_vs_baseline", "bubble_s",
              "overlap_ratio", "efficiency", "throughput_samples_s", "cpu_busy", "workers_cpu_busy",
              "params_consistent", "step_time_iqr_s", "bubble_method"}
BASELINE_KEYS = {"forward_s", "backward_s", "compute_s", "comm_s", "compute_under_comm_s",
                 "lower_bound_s", "no_overlap_s", "ceiling_speedup_vs_ddp"}


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the bench CLI; ``.args`` of the result is the run's pid (its namespace prefix)."""
    with subprocess.Popen(
        [sys.executable, "-m", "commsched.plugins.torch.bench", "--workload", "tiny",
         "--workers", "2", "--steps", "3", "--warmup", "1", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # let it tear its network down
            proc.communicate(timeout=60)
            raise
    return subprocess.CompletedProcess(proc.pid, proc.returncode, out, err)


def _check_entry(entry: dict, report: dict) -> None:
    assert ENTRY_KEYS <= entry.keys()
    assert list(entry) == list(RESULT_KEYS)  # the one schema of every framework (docs/bench.md)
    assert entry["status"] == "ok", entry.get("reason")
    assert entry["step_time_s"] > 0
    assert entry["step_time_iqr_s"] >= 0
    assert entry["bubble_s"] is not None and entry["bubble_s"] >= 0
    assert entry["params_consistent"] is True
    assert 0 <= entry["workers_cpu_busy"] <= 1.05  # CPU seconds / wall can jitter just above
    base = report["baseline"]
    # The derived metrics follow their definitions exactly.
    assert entry["efficiency"] == pytest.approx(base["lower_bound_s"] / entry["step_time_s"])
    # overlap = 1 - exposed / comm in [0, 1], exposed = the bubble; n/a below the noise floor
    if entry["overlap_ratio"] is None:
        assert entry["overlap_method"].startswith("n/a")
    else:
        assert 0 <= entry["overlap_ratio"] <= 1
        assert entry["exposed_comm_s"] == pytest.approx(entry["bubble_s"])
        assert entry["overlap_ratio"] == pytest.approx(
            min(1.0, max(0.0, 1 - entry["exposed_comm_s"] / base["comm_s"])))
    # every entry has a breakdown whose numbers add up and say how they were measured
    b = entry["breakdown"]
    assert set(b["how"]) >= {k for k in b if k not in ("per_rank", "how")}
    assert len(b["per_rank"]) == report["config"]["workers"]
    for r in b["per_rank"]:
        # the waits and applies are timed inside the forward: per step, compute = forward - both >= 0
        assert 0 <= r["forward_compute_s"] <= r["forward_s"]
        assert r["optimizer_apply_s"] > 0
    if entry["strategy"] in ("fifo", "dynamic", "static"):
        assert b["sched_cpu_s"] > 0 and b["sched_cpu_per_piece_s"] > 0 and b["submit_s"] > 0
        # the division by the world size runs on the completion thread for every task
        assert b["sched_engine_cpu_s"]["on_done"] > 0
        assert 0 <= b["sched_own_cpu_per_piece_s"] <= b["sched_cpu_per_piece_s"]
    if entry["strategy"] == "dynamic":
        assert b["decision_latency"]["pieces"] > 0 and b["decision_latency"]["latency_s"]["p50"] >= 0
    assert entry["throughput_samples_s"] == pytest.approx(
        report["config"]["batch_size"] * report["config"]["workers"] / entry["step_time_s"])


def test_loopback_run_writes_report_table_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = _bench("--network", "loopback", "--strategies", "ddp,horovod",
                  "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == SCHEMA
    assert report["emulation"] == "loopback"
    assert "loopback" in proc.stderr  # says it runs unshaped
    assert report["config"]["workers"] == 2 and report["config"]["steps"] == 3
    assert BASELINE_KEYS <= report["baseline"].keys()
    base = report["baseline"]
    # compute beside all-reduces that outlast it, where one all-reduce did not (the stream phase)
    # (skipped only where one all-reduce lasted the whole compute: rank 0's coverage)
    if base["stream_allreduces"] is None:
        assert base["under_comm_coverage"] >= 0.99 and base["compute_under_stream_s"] is None
    else:
        assert base["stream_allreduces"] >= 1 and base["compute_under_stream_s"] > 0
        assert 0 < base["stream_coverage"] <= 1 and base["stream_alone_s"] > 0
    assert base["contention"] >= 1.0
    assert report["workload"]["param_bytes"] > 0 and report["workload"]["layers"]
    assert [r["strategy"] for r in report["results"]] == ["ddp", "horovod"]
    ddp, horovod = report["results"]
    _check_entry(ddp, report)
    assert report["framework"] == "torch" and report["baseline_strategy"] == "ddp"
    assert ddp["speedup_vs_baseline"] == 1.0
    if importlib.util.find_spec("horovod") is None:
        assert horovod["status"] == "skipped" and "horovod" in horovod["reason"]
        assert horovod["step_time_s"] is None
    else:
        _check_entry(horovod, report)
        assert horovod["speedup_vs_baseline"] == pytest.approx(
            ddp["step_time_s"] / horovod["step_time_s"])
    assert "| ddp |" in proc.stdout and "| horovod |" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_users_module_function_workload_runs_in_the_workers(tmp_path):
    # The workers import the user's module from the directory bench was started in.
    (tmp_path / "my_model.py").write_text(
        "import torch\n"
        "def build():\n"
        "    def batch(n, gen):\n"
        "        return torch.randn(n, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)), batch, "
        "torch.nn.functional.cross_entropy, 4\n")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "commsched.plugins.torch.bench", "--workload", "my_model:build", "--workers", "2",
         "--steps", "2", "--warmup", "1", "--network", "loopback", "--strategies", "ddp,dynamic", "--json", str(out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["config"]["workload"] == "my_model:build" and report["config"]["batch_size"] == 4
    assert [r["status"] for r in report["results"]] == ["ok", "ok"]
    assert report["workload"]["num_params"] == 8 * 16 + 16 + 16 * 3 + 3


def test_rounds_interleave_the_strategies_and_pair_the_speedups(tmp_path):
    out = tmp_path / "r.json"
    proc = _bench("--network", "loopback", "--strategies", "ddp,dynamic", "--rounds", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["extra"]["rounds"] == 2
    ddp, dynamic = report["results"]
    for entry in (ddp, dynamic):
        _check_entry(entry, report)
        assert [(x["round"], x["status"]) for x in entry["rounds"]] == [(1, "ok"), (2, "ok")]
        assert entry["measured_steps"] == 2 * 3  # every round's steps pooled
    # round 2 runs the list rotated: dynamic first, then ddp
    assert [x["position"] for x in ddp["rounds"]] == [1, 2] and [x["position"] for x in dynamic["rounds"]] == [2, 1]
    paired = [d["step_time_s"] / x["step_time_s"] for d, x in zip(ddp["rounds"], dynamic["rounds"], strict=True)]
    assert dynamic["speedup_vs_baseline"] == pytest.approx(sum(paired) / 2)  # the median of two
    assert "dynamic (round 2/2): done" in proc.stderr and "Per round" in proc.stdout


def test_interleave_alternates_the_strategies_in_one_phase_and_pairs_the_blocks(tmp_path):
    out = tmp_path / "r.json"
    proc = _bench("--network", "loopback", "--strategies", "ddp,dynamic,auto", "--interleave", "3",
                  "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["config"]["extra"]["interleave"] == 3
    assert "[2/2] interleaved: done" in proc.stderr  # one phase for the three
    entries = report["results"]
    for entry in entries:
        _check_entry(entry, report)
        assert [(x["round"], x["status"]) for x in entry["rounds"]] == [(1, "ok"), (2, "ok"), (3, "ok")]
        assert entry["measured_steps"] == 3 * 3  # every block's steps pooled
        assert all(len(x["step_times_s"]) == 3 for x in entry["rounds"])
        assert all(r["final_sync_s"] >= 0 for r in entry["breakdown"]["per_rank"])  # the trail's drain
    # every block runs the three once, in a row of the Williams design
    for block in range(3):
        assert sorted(e["rounds"][block]["position"] for e in entries) == [1, 2, 3]
    assert [e["rounds"][1]["position"] for e in entries] != [e["rounds"][0]["position"] for e in entries]
    auto = entries[2]
    assert all(x["tuner"] is not None and x["tuner"]["kept"] for x in auto["rounds"])
    assert "Per block of the one interleaved phase" in proc.stdout


@pytest.mark.parametrize(("argv", "fix"), [
    (["--workload", "no_such_module_xyz:f"], "no_such_module_xyz"),
    (["--workload", "nope"], "balanced"),
    (["--strategies", "ddp:-1"], "ddp:4"),
    (["--strategies", "ddp,nccl"], "dynamic"),
    (["--workers", "4", "--nodes", "3"], "divide"),
    (["--bandwidth", "1gbps"], "gbit"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--interleave", "1"], "--interleave is the number of blocks"),
    (["--interleave", "4", "--rounds", "3"], "give one"),
    (["--interleave", "4", "--strategies", "ddp,horovod"], "without --interleave"),
])
def test_bad_arguments_exit_2_naming_the_fix(argv, fix, capsys):
    import argparse

    from commsched.bench import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args([*argv, "--json", "/nonexistent/never.json"])) == 2
    assert fix in capsys.readouterr().err


@needs_root
def test_netns_run_is_shaped_and_leaves_no_namespace(tmp_path):
    out = tmp_path / "r.json"
    proc = _bench("--bandwidth", "1gbit", "--strategies", "ddp,dynamic", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["emulation"] == "netns"
    assert "tbf 1gbit" in report["emulation_note"]
    ddp, dynamic = report["results"]
    _check_entry(ddp, report)
    _check_entry(dynamic, report)  # commsched: bubble from opt.stats(), ranks bitwise equal
    assert dynamic["stats"]["ordering"] == "dynamic"
    assert [ns for ns in netns.list_namespaces() if ns.startswith(f"cs{proc.args}_")] == []


@needs_root
def test_sigint_mid_run_kills_workers_and_removes_the_network(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "commsched.plugins.torch.bench", "--workload", "tiny",
         "--workers", "2", "--steps", "100000", "--strategies", "ddp",
         "--json", str(tmp_path / "r.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, TMPDIR=str(tmp_path)),  # the interrupted run keeps its logs: under tmp_path, not /tmp
    )
    prefix = f"cs{proc.pid}_"
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while time.monotonic() < deadline and not workers:
            for ns in netns.list_namespaces():
                if ns.startswith(prefix) and not ns.endswith("sw"):
                    workers += netns.namespace_pids(ns)
            time.sleep(0.1)
        assert workers, "no worker started inside the run's namespaces"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err and f"logs in {tmp_path}/commsched-bench-" in err
    assert [ns for ns in netns.list_namespaces() if ns.startswith(prefix)] == []
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    assert not (tmp_path / "r.json").exists()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
