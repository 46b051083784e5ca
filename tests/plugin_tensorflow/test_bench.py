"""The TensorFlow benchmark runs end to end (unshaped loopback, a tiny model) and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")


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
    assert data["framework"] == "tensorflow" and data["workers"] == 2 and data["gradient_mb"] > 0
    assert {"network", "bandwidth", "spec", "cpu_busy_warning"} <= set(data)
    rows = {r["strategy"]: r for r in data["results"]}
    assert list(rows) == ["mwms", "dynamic"]
    for row in rows.values():
        assert row["status"] == 0 and row["step_s"] > 0 and row["iqr_s"] >= 0 and row["steps"] >= 2
        assert row["world"] == 2 and "cpu_busy" in row and "wall_s" in row
    assert rows["mwms"]["vs_mwms"] == 1.0 and rows["mwms"]["speedup_vs_mwms"] == 1.0
    assert rows["dynamic"]["speedup_vs_mwms"] > 0 and rows["dynamic"]["pieces_per_step"] > 4
    assert "| dynamic |" in proc.stdout and "| mwms |" in proc.stdout
