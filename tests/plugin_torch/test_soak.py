"""A short soak (scripts/soak.py, 200 steps on torch/gloo, 2 ranks) with the long soak's
assertions: RSS growth after warm-up < 5 %, a constant thread count, a constant number
of store keys. ``make soak`` runs 2,000 steps per backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.timeout(240)
def test_200_steps_keep_memory_threads_and_store_keys_flat(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--backends", "torch", "--steps", "200",
                           "--every", "10", "--out", str(out), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=220)
    report = json.loads(out.read_text())["torch"]
    assert report["ok"], f"{report}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    assert proc.returncode == 0
    for rank in report["ranks"]:
        assert rank["rss_growth"] < 0.05 and len(rank["threads"]) == 1, rank
        assert rank["pieces"] >= 200 * 10  # every step split its tensors into many pieces
    assert len(report["ranks"][0]["store_keys"]) == 1  # rank 0 hosts the store: its key count never moved
