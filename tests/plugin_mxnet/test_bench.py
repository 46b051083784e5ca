"""The MXNet benchmark runs end to end (unshaped loopback, a tiny model) and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mxnet")

from commsched.bench.report import REPORT_KEYS, RESULT_KEYS, SCHEMA, TABLE_HEADER  # noqa: E402


@pytest.mark.timeout(120)
def test_the_benchmark_compares_dist_sync_with_commsched(tmp_path):
    report = tmp_path / "mxnet.json"
    proc = subprocess.run(
        [sys.executable, "-m", "commsched.plugins.mxnet.bench", "--network", "loopback", "--json", str(report),
         "--strategies", "dist_sync,dynamic", "--hidden", "64", "--layers", "2", "--batch-size", "8",
         "--steps", "4", "--warmup", "1", "--partition-mb", "0.01", "--credit-mb", "0.02", "--timeout", "60"],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["schema"] == SCHEMA and list(data) == list(REPORT_KEYS)
    assert data["framework"] == "mxnet" and data["baseline_strategy"] == "dist_sync"
    assert data["config"]["workers"] == 2 and data["config"]["nodes"] == 3 and data["workload"]["param_bytes"] > 0
    rows = {r["strategy"]: r for r in data["results"]}
    assert list(rows) == ["dist_sync", "dynamic"]
    for row in rows.values():
        assert list(row) == list(RESULT_KEYS)
        assert row["status"] == "ok" and row["step_time_s"] > 0 and row["step_time_iqr_s"] >= 0
        assert row["measured_steps"] == 3  # 4 steps after the warmup: 3 intervals
    assert rows["dist_sync"]["speedup_vs_baseline"] == 1.0
    assert rows["dynamic"]["speedup_vs_baseline"] > 0 and rows["dynamic"]["pieces_per_step"] > 4
    assert TABLE_HEADER in proc.stdout
    assert "| dynamic |" in proc.stdout
