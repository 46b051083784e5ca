"""The README's example runs under torchrun and reports what the scheduler did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cross", [True, False], ids=["cross-iteration", "synchronous"])
def test_torch_example_runs_under_torchrun(tmp_path, cross):
    out = tmp_path / "stats.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "torch_train.py"), "--steps", "8", "--width", "128", "--json", str(out)]
    if not cross:
        cmd.append("--no-cross-iteration")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "bubble per step" in proc.stdout
    stats = json.loads(out.read_text())
    assert stats["steps"] == 8 and stats["cross_iteration"] is cross
    # 13 parameters, some split into several pieces; runs of small ones fused (fusion_bytes) into one task
    tasks = 13 - sum(len(members) - 1 for members in stats["fused"].values())
    assert stats["pieces"] >= 8 * tasks
