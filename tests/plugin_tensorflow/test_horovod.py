"""backend="horovod": two ranks under horovodrun (gloo), against plain hvd.allreduce."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

HERE = Path(__file__).resolve().parent


def _horovod_with_tensorflow() -> str | None:
    """None if horovod.tensorflow works here, else why not (checked in a subprocess: it loads a C library)."""
    probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow as hvd; hvd.init(); hvd.shutdown()"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return None


@pytest.mark.timeout(240)
def test_horovod_backend_sums_like_hvd_allreduce_and_the_tape_averages(tmp_path, tf_worker_env):
    why = _horovod_with_tensorflow()
    if why is not None:
        pytest.skip(f"horovod.tensorflow is not usable here ({why}); build it with `make horovod` "
                    "(HOROVOD_WITH_TENSORFLOW=1)")
    horovodrun = Path(sys.executable).parent / "horovodrun"
    env = tf_worker_env()
    proc = subprocess.Popen([str(horovodrun), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                             str(HERE / "hvd_worker.py"), str(tmp_path)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # horovodrun and the ranks it started (its own session)
        out, _ = proc.communicate()
        pytest.fail("horovodrun did not finish in 200 s:\n" + out[-3000:])
    for rank in range(2):
        path = tmp_path / f"hvd.{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing (rc={proc.returncode}):\n{out[-3000:]}"
        r = json.loads(path.read_text())
        assert "crash" not in r, r["crash"]
        assert r["size"] == 2
        assert r["bitwise"], r
        assert r["iterations"] == 4
        assert r["hvd_ops"] == r["pieces"] > 4  # one Horovod all-reduce per planned piece
        assert r["fusion_bytes"] == 0 and r["off_chain"] == 0  # Horovod fuses itself: every gradient on a chain
        assert r["tape_allclose"]
