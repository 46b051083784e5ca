"""Faults on TF collective ops: SIGKILL of a worker mid-step.

* The survivor of a SIGKILL a fraction into a step (worker.py's ``kill`` scenario, the
  step compiled with ``commsched.plugins.tensorflow.function``) raises commsched's own
  class within ``timeout_s`` + 5 s: a :class:`~commsched.errors.CommunicationError`
  (peer gone) or :class:`~commsched.errors.CommschedTimeout` (peer silent), the TF error
  as its cause; every process exits.
* A seeded sample of the kill matrix (scripts/faults.py), judged by that script.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers import REPO

pytest.importorskip("tensorflow")

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 5.0  # the kill scenario's SchedulerConfig(timeout_s=...)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim,fraction", [(1, 0.3), (0, 0.7)])
def test_sigkill_mid_step_gives_the_survivor_a_commsched_error_within_the_timeout(tmp_path, tf_launch, victim,
                                                                                  fraction):
    outs = [tmp_path / f"kill.{rank}.json" for rank in range(2)]
    procs = tf_launch(lambda rank: [sys.executable, str(HERE / "worker.py"), "kill", str(outs[rank])], tmp_path,
                   timeout=200, env={"COMMSCHED_TEST_VICTIM": str(victim), "COMMSCHED_TEST_FRACTION": str(fraction)})
    survivor = 1 - victim
    assert procs[victim].returncode == -9, procs[victim].stdout[-2000:]  # it died of its SIGKILL
    assert procs[survivor].returncode == 0, procs[survivor].stdout[-3000:]  # it exited by itself, no crash
    killed_at = float(Path(str(outs[victim]) + ".killed").read_text())
    got = json.loads(outs[survivor].read_text())
    assert "crash" not in got, got["crash"]
    assert got["error"] is not None, "the survivor finished its steps without the other worker"
    assert got["is_commsched"] and (got["is_communication_error"] or got["is_timeout"]), got
    assert got["cause_is_tf"], got  # TF's own error, chained
    assert got["time"] - killed_at < TIMEOUT_S + 5, got


@pytest.mark.timeout(300)
def test_sigkill_of_either_worker_mid_step_is_clean_in_the_kill_matrix_sample(tmp_path):
    spec = importlib.util.spec_from_file_location("commsched_faults", REPO / "scripts" / "faults.py")
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    seeds = [s for s in range(50) if faults.plan_for("tensorflow", s)["victim"] == 1][:1] + \
            [s for s in range(50) if faults.plan_for("tensorflow", s)["victim"] == 0][:1]
    for seed in seeds:
        r = faults.run_kill("tensorflow", seed, tmp_path, 5.0)
        assert r["clean"], f"seed {seed}: {r['why']}\nsurvivor: {r['survivor']}"
        assert r["returncodes"] != [-11, -11]
