"""A seeded sample of the kill matrix (scripts/faults.py) on the commsched KVStore (ps-lite dist_sync).

One worker SIGKILLs itself after backward was queued, with pieces in flight, or
before the next forward; the other must raise a CommschedError within timeout_s + 5 s
and every process of the job (scheduler, server, workers, launcher) must exit.
"""

from __future__ import annotations

import importlib.util

import pytest
from helpers import REPO

pytest.importorskip("mxnet")


@pytest.mark.timeout(300)
def test_sigkill_of_a_worker_in_each_phase_fails_the_other_clearly(tmp_path):
    spec = importlib.util.spec_from_file_location("commsched_faults", REPO / "scripts" / "faults.py")
    faults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(faults)
    by_phase = {}
    for seed in range(100):
        by_phase.setdefault(faults.plan_for("mxnet", seed)["phase"], seed)
    assert set(by_phase) == set(faults.PHASES["mxnet"])
    for phase, seed in sorted(by_phase.items()):
        r = faults.run_kill("mxnet", seed, tmp_path, 5.0)
        assert r["clean"], f"seed {seed} ({phase}): {r['why']}\nsurvivor: {r['survivor']}"
