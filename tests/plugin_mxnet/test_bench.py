"""The MXNet benchmark runs end to end (unshaped loopback, a tiny model) and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mxnet")


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
    rows = {r["strategy"]: r for r in data["results"]}
    assert rows["dist_sync"]["step_s"] > 0 and rows["dist_sync"]["vs_dist_sync"] == 1.0
    assert rows["dynamic"]["step_s"] > 0 and rows["dynamic"]["pieces_per_step"] > 4
    assert "| dynamic |" in proc.stdout
