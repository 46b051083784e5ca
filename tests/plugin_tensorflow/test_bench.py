"""The TensorFlow benchmark runs end to end (unshaped loopback, a tiny model) and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

from commsched.bench.report import REPORT_KEYS, RESULT_KEYS, SCHEMA, TABLE_HEADER  # noqa: E402


@pytest.mark.timeout(120)
def test_the_benchmark_compares_mwms_with_commsched(tmp_path):
    report = tmp_path / "tensorflow.json"
    proc = subprocess.run(
        [sys.executable, "-m", "commsched.plugins.tensorflow.bench", "--network", "loopback", "--json", str(report),
         "--strategies", "mwms,dynamic", "--hidden", "32", "--layers", "2", "--batch-size", "8",
         "--steps", "2", "--warmup", "1", "--unroll", "1", "--partition-mb", "0.004", "--credit-mb", "0.008",
         "--timeout", "50"],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["schema"] == SCHEMA and list(data) == list(REPORT_KEYS)
    assert data["framework"] == "tensorflow" and data["baseline_strategy"] == "mwms"
    assert data["config"]["workers"] == 2 and data["workload"]["param_bytes"] > 0
    assert data["emulation"] == "loopback" and data["config"]["bandwidth"] and data["config"]["extra"]["unroll"] == 1
    rows = {r["strategy"]: r for r in data["results"]}
    assert list(rows) == ["mwms", "dynamic"]
    for row in rows.values():
        assert list(row) == list(RESULT_KEYS)
        assert row["status"] == "ok" and row["step_time_s"] > 0 and row["step_time_iqr_s"] >= 0
        assert row["measured_steps"] >= 2
        assert row["throughput_samples_s"] == pytest.approx(2 * 8 / row["step_time_s"])  # world 2 x batch 8
        assert 0 <= row["cpu_busy"] <= 1
    assert rows["mwms"]["speedup_vs_baseline"] == 1.0
    assert rows["dynamic"]["speedup_vs_baseline"] > 0 and rows["dynamic"]["pieces_per_step"] > 4
    stats = rows["dynamic"]["stats"]  # what the graph measured of commsched's pieces
    assert stats["measured_steps"] >= 1 and stats["comm_s"] > 0 and stats["settings"]["slots"] == 2
    pieces = stats["last_step_pieces"]
    assert len(pieces) == rows["dynamic"]["pieces_per_step"] and any(p["slot"] < 0 for p in pieces)  # fused
    assert all(0 <= p["ready_s"] <= p["issue_s"] <= p["done_s"] for p in pieces)
    assert rows["mwms"]["stats"] is None
    assert TABLE_HEADER in proc.stdout
    assert "| dynamic |" in proc.stdout and "| mwms |" in proc.stdout
