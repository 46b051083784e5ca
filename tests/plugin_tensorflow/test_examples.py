"""examples/tf_*.py run, as documented, on two local workers.

Only the Keras 3 custom loop (the recommended path) runs here, to keep the suite
short; tf-keras ``model.fit`` is covered by test_multiworker.py's tf_keras job.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

REPO = Path(__file__).resolve().parents[2]


def _run(args, env, tmp_path, timeout=150):
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "tf_train.py"), "--launch", "2",
                           "--timeout", str(timeout - 20), *args],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(r["rank"] for r in lines) == [0, 1], proc.stdout
    return lines


@pytest.mark.timeout(180)
def test_tf_train_custom_loop_with_unroll(tmp_path, tf_worker_env):
    lines = _run(["--steps", "6", "--unroll", "2", "--width", "64", "--layers", "2",
                  "--partition-bytes", "4KiB", "--timeline", str(tmp_path / "tl.json")], tf_worker_env(), tmp_path)
    assert all(r["mode"] == "commsched" and r["iterations"] == 6 and r["workers"] == 2 for r in lines)
    assert (tmp_path / "tl.rank0.json").exists() and (tmp_path / "tl.rank1.json").exists()
