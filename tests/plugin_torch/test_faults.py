"""A seeded sample of the kill matrix (scripts/faults.py) on torch/gloo and on Horovod.

One rank SIGKILLs itself during backward, with pieces in flight, in the next forward's
wait, or inside an agreed plan/tuning switch (gloo); the survivor must raise a
CommschedError naming the cause within timeout_s + 5 s, every process must exit by
itself, and no commsched thread or store key may be left beyond what a dead rank
leaves (faults.ALLOWED_LEFT). The full matrix (20+ kills per backend) is ``make faults``.
"""

from __future__ import annotations

import importlib.util
import signal

import pytest
from helpers import REPO, horovod_or_skip

TIMEOUT_S = 5.0


def faults_module():
    spec = importlib.util.spec_from_file_location("commsched_faults", REPO / "scripts" / "faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_all_clean(backend: str, seeds, tmp_path) -> list[dict]:
    faults = faults_module()
    records = [faults.run_kill(backend, seed, tmp_path, TIMEOUT_S) for seed in seeds]
    for r in records:
        assert r["clean"], f"{backend} seed {r['seed']} ({r['phase']}, step {r['step']}, victim {r['victim']}): " \
                           f"{r['why']}\nsurvivor: {r['survivor']}"
        assert r["error_after_kill_s"] <= TIMEOUT_S + faults.SLACK_S
    return records


# seeds chosen so the sample covers every phase and both victims (plan_for is deterministic)
def seeds_covering(backend: str, n: int, phases=("backward", "in_flight", "forward_wait")) -> list[int]:
    faults = faults_module()
    wanted = {(p, v) for p in phases for v in (0, 1)}
    chosen, seen = [], set()
    for seed in range(200):
        plan = faults.plan_for(backend, seed)
        key = (plan["phase"], plan["victim"])
        if key in wanted and key not in seen:
            seen.add(key)
            chosen.append(seed)
        if len(chosen) == n:
            break
    return chosen


@pytest.mark.timeout(240)
def test_sigkill_of_either_rank_in_any_phase_fails_the_survivor_clearly_on_gloo(tmp_path):
    seeds = seeds_covering("torch", 4)
    records = assert_all_clean("torch", seeds, tmp_path)
    assert {r["phase"] for r in records} == {"backward", "in_flight", "forward_wait"}
    assert {r["victim"] for r in records} == {0, 1}


@pytest.mark.timeout(240)
def test_sigkill_of_a_rank_fails_the_survivor_clearly_on_horovod(tmp_path):
    horovod_or_skip("torch")
    assert_all_clean("horovod", seeds_covering("horovod", 3), tmp_path)


@pytest.mark.timeout(180)
def test_ctrl_c_in_the_training_loop_exits_within_the_timeout_and_fails_the_other_rank_clearly(tmp_path):
    faults = faults_module()
    seeds = seeds_covering("torch", 6)[:3]  # backward, with pieces in flight, in the next forward's wait
    for seed in seeds:
        r = faults.run_kill("torch", seed, tmp_path, TIMEOUT_S, sig="INT")
        assert r["clean"], f"seed {seed} ({r['phase']}): {r['why']}\nsurvivor: {r['survivor']}"
        assert r["killed"]["signal"] == "INT"
        # the interrupted rank ends by its KeyboardInterrupt (Python re-raises SIGINT: status -2), not a kill
        assert r["returncodes"][r["victim"]] == -signal.SIGINT, r["returncodes"]
        assert r["victim_exit_after_signal_s"] <= TIMEOUT_S + faults.SLACK_S


@pytest.mark.timeout(240)
def test_sigkill_during_a_plan_or_tuning_switch_fails_the_survivor_clearly_on_gloo(tmp_path):
    # one seeded kill per switch ordering: planned (no file) as rank 1 dies between the old scheduler
    # and the new one (rank 0 then waits in the new plan's agreement), auto as rank 0 dies deciding
    faults = faults_module()
    wanted = [("planned", "rebuild", 1), ("auto", "decide", 0)]
    seeds = []
    for ordering, point, victim in wanted:
        seeds.append(next(s for s in range(200) if (p := faults.plan_for("torch", s))["phase"] == "switch"
                          and (p["ordering"], p["switch_point"], p["victim"]) == (ordering, point, victim)))
    records = assert_all_clean("torch", seeds, tmp_path)
    for r, (ordering, point, _) in zip(records, wanted, strict=True):
        assert r["killed"]["in"] == f"switch:{point}", r["killed"]  # it died inside the switch
        assert r["ordering"] == ordering
