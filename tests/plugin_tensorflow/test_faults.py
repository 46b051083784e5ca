"""A seeded sample of the kill matrix (scripts/faults.py) on TF collective ops.

The victim's timer SIGKILLs it a seeded fraction of a step into a step; the survivor
must get an error naming the commsched piece within timeout_s + 5 s (TF raises its
own UnavailableError/DeadlineExceededError from the user's compiled step, not a
CommschedError), and every process must exit.
"""

from __future__ import annotations

import importlib.util

import pytest
from helpers import REPO

pytest.importorskip("tensorflow")


@pytest.mark.timeout(300)
def test_sigkill_of_either_worker_mid_step_fails_the_survivor_naming_the_piece(tmp_path):
    spec = importlib.util.spec_from_file_location("commsched_faults", REPO / "scripts" / "faults.py")
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    seeds = [s for s in range(50) if faults.plan_for("tensorflow", s)["victim"] == 1][:1] + \
            [s for s in range(50) if faults.plan_for("tensorflow", s)["victim"] == 0][:1]
    for seed in seeds:
        r = faults.run_kill("tensorflow", seed, tmp_path, 5.0)
        assert r["clean"], f"seed {seed}: {r['why']}\nsurvivor: {r['survivor']}"
        assert r["returncodes"] != [-11, -11]
