"""The overhead micro-benchmark runs and writes its JSON (structure only: it is not a timed test)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_overhead_benchmark_writes_scheduled_bare_and_overhead_per_piece(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, "-m", "commsched.bench.overhead", "--json", str(out), "--pieces", "64", "--ranks", "2",
         "--repeat", "1", "--pieces-per-tensor", "4"],
        capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "overhead" in proc.stdout and "us per piece" in proc.stdout
    report = json.loads(out.read_text())
    assert report["target_us_per_piece"] == 50.0
    assert [r["ranks"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["pieces_per_rank"] == 64
        for part in ("scheduled", "bare", "overhead"):
            assert isinstance(r[part]["cpu_us_per_piece"], float)
            assert isinstance(r[part]["wall_us_per_piece"], float)
        assert r["scheduled"]["cpu_us_per_piece"] > 0 and r["bare"]["cpu_us_per_piece"] > 0
        assert isinstance(r["within_target"], bool)


def test_overhead_benchmark_rejects_nonsense_arguments(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "commsched.bench.overhead", "--pieces", "0"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "--pieces" in proc.stderr
