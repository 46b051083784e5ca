"""Reference equivalence: commsched training equals plain synchronous training
(all-reduce every gradient, divide by world size, the plain optimizer's step()).

Bitwise on 2 ranks, allclose on 4; pieces and credit are small so every tensor is
split and pieces queue. Each test runs many scenarios in one pair of processes,
because starting torch dominates the wall time here.
"""

from __future__ import annotations

import json
import re

import pytest

from commsched.plan import OBSERVED_STEP
from helpers import assert_partitioned_within_credit

OPTIMIZERS = ["sgd_momentum", "adam", "adamw", "rmsprop", "adagrad", "sgd"]


def scenarios(*items: dict) -> list[str]:
    flags = []
    for item in items:
        flags += ["--scenario", json.dumps(item)]
    return flags


def check_all(results: list[list[dict]], exact: bool) -> None:
    for rank_results in results:
        for r in rank_results:
            assert "error" not in r, f"rank {r['rank']} {r['scenario']}: {r['error']}"
            if exact:
                assert r["bitwise"], f"rank {r['rank']} not bitwise equal for {r['scenario']}: {r['diffs']}"
            else:
                assert r["max_diff"] <= 1e-5, f"rank {r['rank']} {r['scenario']}: {r['diffs']}"
            assert r["threads_after_close"] == [], r["threads_after_close"]
            if r["expected_pieces"] is None:
                continue
            # partition 256 B: every tensor above it was split; pieces queued behind the 1 KiB credit
            assert_partitioned_within_credit(r["order"], r["expected_pieces"], r["max_in_flight_bytes"],
                                             r["scenario"]["credit"], f"rank {r['rank']} {r['scenario']}")


@pytest.mark.timeout(240)
def test_every_optimizer_bitwise_on_two_ranks_in_dynamic_and_static_order(ranks):
    items = [{"optimizer": o, "ordering": order} for o in OPTIMIZERS for order in ("dynamic", "static")]
    results = ranks(2, *scenarios(*items), timeout=220)
    check_all(results, exact=True)
    # the forward waited for some multi-piece gradients and applied them range by range
    assert sum(r["stats"]["ranged_apply"]["updates"] for r in results[0]) > 0
    # ranks issued the same sequence, and static repeats step 1's order afterwards
    for a, b in zip(results[0], results[1], strict=True):
        assert a["order"] == b["order"]
        if a["scenario"]["ordering"] == "static":
            steps = sorted(a["order"], key=int)
            assert a["order"][steps[-1]]["order"] == a["order"][steps[-2]]["order"]


@pytest.mark.timeout(200)
def test_random_per_rank_backward_delays_keep_results_bitwise(ranks):
    items = [{"optimizer": o, "ordering": order, "delay": 0.003, "steps": 6}
             for o in ("sgd_momentum", "adam") for order in ("dynamic", "static")]
    check_all(ranks(2, *scenarios(*items), timeout=180), exact=True)


@pytest.mark.timeout(200)
def test_tied_unused_fp16_lr_scheduler_state_dict_accumulation_and_sync_path(ranks):
    items = [
        {"model": "tied", "optimizer": "adam"},
        {"model": "tied", "optimizer": "sgd_momentum", "ordering": "static"},
        {"model": "branchy", "optimizer": "adam"},                       # a branch unused on every rank
        {"model": "branchy", "optimizer": "sgd_momentum", "ordering": "static"},
        {"dtype": "float16", "optimizer": "sgd"},
        {"dtype": "bfloat16", "optimizer": "sgd_momentum"},
        {"optimizer": "adamw", "lr_scheduler": True},
        {"optimizer": "adam", "state_roundtrip": True},
        {"optimizer": "sgd_momentum", "accum": 3},
        {"optimizer": "adam", "accum": 2, "no_sync": True},
        {"optimizer": "adam", "cross": 0},
        {"optimizer": "sgd_momentum", "cross": 0, "ordering": "static"},
        {"optimizer": "sgd_groups", "lr_scheduler": True},                # param groups, different LRs
        {"optimizer": "adam", "desync_init": True},                      # broadcast from rank 0
    ]
    results = ranks(2, *scenarios(*items), timeout=180)
    check_all(results, exact=True)
    by = {json.dumps(r["scenario"], sort_keys=True): r for r in results[0]}
    lr_case = next(r for r in by.values() if r["scenario"]["lr_scheduler"])
    assert lr_case["lr"] == pytest.approx(1e-2 * 0.5 ** 5)  # StepLR applied through the wrapper
    assert all(r.get("state_equal_format", True) for r in by.values())
    tied = next(r for r in by.values() if r["scenario"]["model"] == "tied")
    # the tied embedding is one parameter, communicated once, with the priority of its first use
    assert tied["stats"]["priorities"] == {"embed.weight": 0, "mix.weight": 1, "mix.bias": 2}


@pytest.mark.timeout(200)
def test_split_tied_embeddings_stay_allclose_and_send_the_projection_part_first(ranks):
    """split_tied_embeddings: the head's part of the tied weight is reduced as soon as backward made it (first
    in the step's order, where without the split the weight waits for the lookup, last in backward) and the
    lookup's rows are exchanged once a step; allclose to the reference on both paths, in static order, with
    fusion (the split weight stays alone), when the head is skipped every other step (its part is zero), and
    with gradient accumulation (backward_passes_per_step and no_sync: one row exchange a step)."""
    split = {"model": "gpt", "split_tied": True}
    items = [{"model": "gpt", "optimizer": "adam"},  # no split: bitwise, and the weight goes last
             dict(split, optimizer="adam"), dict(split, optimizer="sgd_momentum", cross=0),
             dict(split, optimizer="adam", ordering="static"), dict(split, optimizer="adam", fusion=1 << 16),
             dict(split, optimizer="adam", alternate_branch=True, steps=6),
             # gradient accumulation: the passes' rows are kept and exchanged once, with the last pass's
             dict(split, optimizer="adam", accum=2, steps=4), dict(split, optimizer="adam", accum=2, cross=0, steps=4),
             # planned in-process: the plan is made from the recorded steps, which have the split's readiness
             dict(split, optimizer="adam", ordering="planned", steps=8),
             dict(split, optimizer="sgd_momentum", accum=3, no_sync=True, cross=0, steps=4)]
    results = ranks(2, *scenarios(*items), timeout=180)
    plain = results[0][0]
    check_all([r[:1] for r in results], exact=True)
    check_all([r[1:] for r in results], exact=False)
    first = [step["order"][0] for step in plain["order"].values()]
    assert not any(name.startswith("embed.weight") for name in first), first
    for a, b in zip(results[0][1:], results[1][1:], strict=True):
        sc = a["scenario"]
        assert a["order"] == b["order"], sc
        assert a["stats"]["tied_embeddings"]["embed"]["exchanges"] == sc["steps"], a["stats"]["tied_embeddings"]
        assert a["stats"]["tied_embeddings"]["embed"]["rows"] > 0
        assert "embed.weight" not in [m for members in a["stats"]["fused"].values() for m in members], sc
        if not sc["alternate_branch"]:  # with the head in every step, its part is ready first
            first = [step["order"][0] for step in a["order"].values()]
            assert all(name.startswith("embed.weight") for name in first), (sc, first)


@pytest.mark.timeout(120)
def test_gradient_on_one_rank_only_fails_on_every_rank_naming_it(ranks):
    results = ranks(2, *scenarios({"model": "branchy", "unused_on_rank": 1, "steps": 3}), timeout=100)
    for rank_results in results:
        error = rank_results[0].get("error", "")
        assert "unused" in error and "unused." in error.replace("'", ""), error


@pytest.mark.timeout(150)
def test_fifo_ranks_that_reduce_other_same_sized_tensors_fail_naming_them_and_only_the_check_catches_it(ranks):
    """Rank 0 trains head ``a``, rank 1 head ``b`` of the same shape: under fifo gloo pairs the pieces by
    position and sums ``a``'s gradient with ``b``'s. The check at the end of each step (verify_order,
    commsched.order_check) fails every rank naming both; without it the ranks train on silently."""
    twin = {"model": "twin", "ordering": "fifo", "steps": 3}
    # a failed scenario ends its processes' run (their process group may be unusable): one run per failure
    first = ranks(2, *scenarios(dict(twin, verify_order=False), dict(twin, fusion=1 << 16, cross=0)), timeout=60)
    second = ranks(2, *scenarios(twin), timeout=60)
    for (silent, fused), (alone,) in zip(first, second, strict=True):
        assert "error" not in silent, silent["error"]  # what the check is for: no engine error, wrong sums
        assert silent["stats"]["order_checks"] == 0 and not any(silent["order_checked"].values()), silent
        for r in (fused, alone):
            assert r.get("error_type") in ("OrderAgreementError", "RemoteAbort"), r.get("error")
            assert "ordering='fifo'" in r["error"] and "step 0" in r["error"], r["error"]
            for head in ("a", "b"):  # the first tensor that differs: a head's own, or its fusion group's
                assert re.search(rf"\b{head}\.(weight|bias)", r["error"]), r["error"]
            assert "on rank 0" in r["error"] and "on rank 1" in r["error"], r["error"]
            assert r["error_after_start_s"] < 15, r["error_after_start_s"]  # within a step or two, not a timeout
            assert r["threads_after_close"] == [], r["threads_after_close"]


@pytest.mark.timeout(200)
def test_four_ranks_allclose_dynamic_and_static(ranks):
    items = [{"optimizer": "adam", "ordering": "dynamic", "delay": 0.002, "steps": 6},
             {"optimizer": "sgd_momentum", "ordering": "static", "steps": 6}]
    results = ranks(4, *scenarios(*items), timeout=180)
    check_all(results, exact=False)
    for other in results[1:]:
        assert [r["order"] for r in other] == [r["order"] for r in results[0]]


@pytest.mark.timeout(200)
def test_two_data_parallel_groups_of_one_job_each_train_bitwise_on_their_own_process_group(ranks):
    """process_group=: ranks {0, 2} and {1, 3} train two replicas on two data streams. Each group's rank 0
    decides the order for its own group only (its keys in the job's shared store are its own), the
    start is broadcast from the group's own rank 0 (global rank 1 for the second group), and a tied
    embedding's rows are exchanged within the group."""
    items = [{"optimizer": "adam", "ordering": "dynamic", "dp_groups": 2, "desync_init": True, "delay": 0.002,
              "steps": 6},
             {"optimizer": "sgd_momentum", "ordering": "static", "dp_groups": 2, "steps": 6},
             # the tuner's switches are agreed within each group (its own keys, its own rank 0)
             {"ordering": "auto", "optimizer": "adam", "fast_tuner": True, "dp_groups": 2, "steps": 20},
             # the tied split's rows go on a twin of each group, made by that group's ranks only
             {"model": "gpt", "split_tied": True, "optimizer": "adam", "dp_groups": 2, "steps": 4}]
    results = ranks(4, *scenarios(*items), timeout=180)
    check_all([r[:3] for r in results], exact=True)
    check_all([r[3:] for r in results], exact=False)
    assert all(r[3]["stats"]["tied_embeddings"]["embed"]["exchanges"] == 4 for r in results)
    for leader, follower in ((0, 2), (1, 3)):  # each group's own rank 0 decides its switches
        tuner, follows = results[leader][2]["stats"]["tuner"], results[follower][2]["stats"]["tuner"]
        assert tuner["role"] == "decides" and follows["role"] == "follows"
        assert tuner["switches"] == follows["switches"]
        assert len([s for s in tuner["switches"] if s["settings"] is not None]) >= 2, tuner["switches"]
    for a, b in ((0, 2), (1, 3)):
        for ra, rb in zip(results[a], results[b], strict=True):
            assert ra["group_ranks"] == rb["group_ranks"] == [a, b]
            assert ra["param_sha256"] == rb["param_sha256"] and ra["order"] == rb["order"], ra["scenario"]
    for r0, r1 in zip(results[0], results[1], strict=True):  # two replicas, two data streams
        assert r0["param_sha256"] != r1["param_sha256"], r0["scenario"]


@pytest.mark.timeout(120)
def test_a_rank_that_dies_mid_training_makes_the_others_fail_clearly_not_hang(ranks):
    results = ranks(2, *scenarios({"die_rank": 1, "die_step": 3, "steps": 8}), timeout=100, may_die=(1,))
    assert results[1] is None  # it died
    survivor = results[0][0]
    assert survivor.get("error_is_commsched"), survivor.get("error")
    # rank 1 exits with its step-3 pieces unsent and publishes nothing, so rank 0's engine sees the
    # closed connection: a CommunicationError naming the tensor, the piece and the rank
    assert re.match(r"CommunicationError: reducing tensor '[\w.]+' \(piece \d+, elements \d+:\d+\) "
                    r"failed on rank 0: ", survivor["error"]), survivor["error"]
    # from the step in which rank 1 died: within the scheduler's timeout_s, plus the 5 s the issue allows
    assert survivor["error_after_s"] < survivor["timeout_s"] + 5, survivor


# ------------------------------------------------------------------ ordering="planned"
def check_planned_order(results: list[list[dict]]) -> None:
    """Every rank issued exactly the plan's piece order, every step (the scheduler's per-step record);
    a plan of ``order`` priority: the plan's pieces, in one order on every rank (rank 0's); of order
    observed, besides, every step after ``OBSERVED_STEP`` in one order (made from that step)."""
    for rank_results in results:
        for i, r in enumerate(rank_results):
            assert r["order"], r["scenario"]
            by_step = {int(step): seen["order"] for step, seen in r["order"].items()}
            if r["scenario"].get("plan_order") == "observed":
                assert max(by_step) > OBSERVED_STEP + 1, "the scenario must replay past the recorded step twice"
            for step, seen in r["order"].items():
                if r["scenario"].get("plan_order") in ("priority", "observed"):
                    assert sorted(seen["order"]) == sorted(r["plan_order"]), f"rank {r['rank']} step {step}"
                    assert seen["order"] == results[0][i]["order"][step]["order"], f"rank {r['rank']} step {step}"
                    if r["scenario"]["plan_order"] == "observed" and int(step) > OBSERVED_STEP:
                        assert seen["order"] == by_step[OBSERVED_STEP + 1], f"rank {r['rank']} step {step}"
                else:
                    assert seen["order"] == r["plan_order"], f"rank {r['rank']} step {step} {r['scenario']}"


@pytest.mark.timeout(150)
def test_planned_with_fused_groups_and_per_group_piece_sizes_is_bitwise_on_two_ranks(ranks):
    items = [{"plan": "fused", "optimizer": "sgd_momentum", "steps": 5},
             {"plan": "fused", "optimizer": "adam", "cross": 0, "steps": 4},
             {"plan": "fused", "optimizer": "adam", "accum": 2, "steps": 3},
             {"plan": "fused", "optimizer": "adam", "steps": 4, "plan_order": "priority", "delay": 0.002},
             {"plan": "fused", "optimizer": "adam", "steps": 5, "plan_order": "observed", "delay": 0.002}]
    results = ranks(2, *scenarios(*items), timeout=130)
    check_all(results, exact=True)
    check_planned_order(results)
    for r in results[0]:
        assert r["stats"]["ordering"] == "planned"
        assert r["plan_order"][0] == "fused[layers.4.weight..layers.4.bias](2)#2"  # out of index order
    # order priority: the plan's cut, rank 0 deciding by priority (the head's pieces in index order)
    for i in (3, 4):
        for seen in results[0][i]["order"].values():
            head = [n for n in seen["order"] if n.startswith("fused[layers.4")]
            assert head == sorted(head, key=lambda n: int(n.rsplit("#", 1)[1])), head
    assert results[0][0]["stats"]["plan"]["fused_groups"] == 2


@pytest.mark.timeout(150)
def test_a_plan_naming_ddps_engine_runs_torchs_reducer_from_step_2_bitwise_on_two_ranks(ranks):
    # the same decision on both ranks at the end of step 0; where the reducer cannot run (accumulation), the
    # plan's own pieces go on, on both ranks, and the record says why
    items = [{"plan": "fused", "plan_engine": 4096, "optimizer": "sgd_momentum", "steps": 6},
             {"plan": "fused", "plan_engine": 4096, "optimizer": "adam", "accum": 2, "steps": 4}]
    results = ranks(2, *scenarios(*items), timeout=130)
    check_all(results, exact=True)
    for a, b in zip(results[0], results[1], strict=True):
        assert a["stats"]["tuner"]["switches"] == b["stats"]["tuner"]["switches"], a["scenario"]
        assert a["stats"]["engine"] == b["stats"]["engine"]
    (switch,) = results[0][0]["stats"]["tuner"]["switches"]
    assert (switch["decided_at"], switch["applies_from"], switch["settings"]["fusion_bytes"]) == (0, 2, 4096)
    for r in (results[0][0], results[1][0]):
        assert r["stats"]["engine"] == "torch-reducer" and r["stats"]["reducer"] == {"bucket_bytes": 4096,
                                                                                     "backwards": 4}
    (kept,) = results[0][1]["stats"]["tuner"]["switches"]
    assert kept["settings"] is None and "backward_passes_per_step > 1" in kept["reason"]
    assert results[0][1]["stats"]["engine"] == "commsched"


@pytest.mark.timeout(150)
@pytest.mark.timeout(240)
def test_auto_on_two_nodes_runs_the_planners_two_level_plan_first_and_stays_allclose(ranks):
    item = {"ordering": "auto", "nodes": 2, "optimizer": "adam", "fast_tuner": True, "steps": 20}
    results = ranks(4, *scenarios(item), timeout=220)
    check_all(results, exact=False)
    switches = [r[0]["stats"]["tuner"]["switches"] for r in results]
    assert all(s == switches[0] for s in switches)  # every rank took the same decisions at the same steps
    first = switches[0][0]  # the model predicts the two-level plan far ahead: it runs first, no margin forced
    notes = results[0][0]["stats"]["tuner"]["model"]  # rank 0's start points, and why
    assert first["plan"] is True and first["settings"]["ordering"] == "planned", (notes, switches[0])
    assert "measured first" in notes[-1], notes
    history = results[0][0]["stats"]["tuner"]["history"]
    assert history[0]["settings"]["ordering"] == "planned" and len(history) >= 2


def test_planned_hierarchical_pieces_on_two_nodes_of_two_ranks_allclose_to_the_reference(ranks):
    items = [{"plan": "fused", "nodes": 2, "optimizer": "adam", "steps": 4},
             {"plan": "fused", "nodes": 2, "optimizer": "sgd_momentum", "cross": 0, "steps": 3}]
    results = ranks(4, *scenarios(*items), timeout=130)
    check_all(results, exact=False)
    check_planned_order(results)
    for rank_results in results:
        assert rank_results[0]["stats"]["plan"]["nodes"] == 2
        assert rank_results[0]["hierarchical_threads"] == 3  # the three-phase pipeline ran here
        assert rank_results[0]["threads_after_close"] == []


@pytest.mark.timeout(60)
def test_a_plan_for_another_model_fails_on_every_rank_naming_the_parameter_before_any_step(ranks):
    results = ranks(2, *scenarios({"plan": "other_model", "steps": 3}), timeout=50)
    for rank_results in results:
        r = rank_results[0]
        assert r.get("error_type") == "PlanMismatch", r.get("error")
        assert "layers.2.weight: plan 992 elements" in r["error"] and "shape [32, 31]" in r["error"], r["error"]
        assert r["error_after_start_s"] < 10, r["error_after_start_s"]
        assert r["threads_after_close"] == []


@pytest.mark.timeout(60)
def test_ranks_with_different_plans_fail_on_every_rank_naming_the_difference_without_hanging(ranks):
    results = ranks(2, *scenarios({"plan": "differs_on_rank1", "steps": 3}), timeout=50)
    for rank_results in results:
        r = rank_results[0]
        assert r.get("error_type") == "PlanMismatch", r.get("error")
        assert "rank 1's plan" in r["error"] and "credit_bytes 2048 vs rank 0's 1024" in r["error"], r["error"]
        assert r["error_after_start_s"] < 10, r["error_after_start_s"]


# ------------------------------------------------------------------ fusion_bytes
@pytest.mark.timeout(240)
def test_small_gradients_fused_by_size_are_bitwise_on_two_ranks_in_every_ordering(ranks):
    # MLP in forward order: 0.weight 2048 B, 0.bias 128, 2.weight 4096, 2.bias 128, 4.weight 512, 4.bias 16
    items = [{"optimizer": o, "ordering": order, "fusion": f, "steps": 5}
             for order in ("dynamic", "static", "fifo") for o, f in (("sgd_momentum", 1024), ("adam", 1 << 16))]
    items += [{"optimizer": "adam", "fusion": 4096, "delay": 0.003, "steps": 5},
              {"model": "tied", "optimizer": "adam", "fusion": 1 << 16, "steps": 4},
              {"model": "branchy", "optimizer": "sgd_momentum", "fusion": 1 << 16, "ordering": "static", "steps": 4},
              {"model": "branchy", "optimizer": "adam", "fusion": 1 << 16, "alternate_branch": True, "steps": 5},
              {"dtype": "bfloat16", "optimizer": "sgd_momentum", "fusion": 1024, "steps": 4},
              {"optimizer": "adam", "fusion": 1024, "cross": 0, "steps": 4},
              {"optimizer": "sgd_momentum", "fusion": 1024, "accum": 2, "steps": 3},
              {"optimizer": "adam", "fusion": 1024, "accum": 2, "no_sync": True, "steps": 3}]
    results = ranks(2, *scenarios(*items), timeout=220)
    check_all(results, exact=True)
    by = {json.dumps(r["scenario"], sort_keys=True): r for r in results[0]}
    for a, b in zip(results[0], results[1], strict=True):
        assert a["stats"]["fused"] == b["stats"]["fused"], a["scenario"]
    small = next(r for r in by.values() if r["scenario"]["fusion"] == 1024 and r["scenario"]["model"] == "mlp")
    # a run of adjacent small gradients (each < 1 KiB, together <= 1 KiB) is one task; 0.bias is alone
    assert small["stats"]["fused"] == {"fused[layers.2.bias..layers.4.bias](3)":
                                       ["layers.2.bias", "layers.4.weight", "layers.4.bias"]}
    whole = next(r for r in by.values() if r["scenario"]["fusion"] == 1 << 16 and r["scenario"]["model"] == "mlp")
    assert list(whole["stats"]["fused"]) == ["fused[layers.0.weight..layers.4.bias](6)"]
    for r in results[0] + results[1]:  # every fifo step ended with the ranks' check of its order, and no other
        checked = r["order_checked"].values()
        assert all(checked) if r["scenario"]["ordering"] == "fifo" else not any(checked), r["scenario"]
    alternating = next(r for r in by.values() if r["scenario"]["alternate_branch"])
    assert any("unused" in m for ms in alternating["stats"]["fused"].values() for m in ms)  # used in step 0
    # odd steps: the group is incomplete, so its members went one by one
    odd = [s for s in alternating["order"].values() if any(n.startswith("trunk.weight#") for n in s["order"])]
    assert odd, alternating["order"]


@pytest.mark.timeout(240)
def test_slack_priority_reranks_on_rank_zero_only_and_stays_bitwise_on_two_ranks(ranks):
    items = [{"priority": "slack", "slack_alpha": 1000.0, "optimizer": "adam", "steps": 9},
             {"priority": "slack", "slack_alpha": 1.0, "optimizer": "sgd_momentum", "steps": 8, "delay": 0.002}]
    results = ranks(2, *scenarios(*items), timeout=220)
    check_all(results, exact=True)
    for a, b in zip(results[0], results[1], strict=True):
        assert a["order"] == b["order"], a["scenario"]  # rank 1 follows rank 0's decisions
        slack_a, slack_b = a["stats"]["slack"], b["stats"]["slack"]
        assert slack_b == {"at_step": 4, "role": "follows rank 0", "alpha": a["scenario"]["slack_alpha"]}
        assert sorted(slack_a["layer_order"]) == list(range(len(slack_a["layer_order"]))), slack_a
        assert "error" not in slack_a and slack_a["layers_moved"] >= 0


# ------------------------------------------------------------------ switches at agreed steps
@pytest.mark.timeout(240)
def test_auto_and_planned_without_a_plan_switch_at_agreed_steps_and_stay_bitwise_on_two_ranks(ranks):
    items = [{"ordering": "auto", "optimizer": "adam", "fast_tuner": True, "steps": 30},
             {"ordering": "auto", "optimizer": "sgd_momentum", "fast_tuner": True, "steps": 22, "cross": 0},
             {"ordering": "auto", "optimizer": "adamw", "fast_tuner": True, "steps": 22, "delay": 0.002,
              "lr_scheduler": True},
             {"ordering": "auto", "optimizer": "adam", "fast_tuner": True, "steps": 26, "auto_plan": True},
             {"ordering": "auto", "optimizer": "adam", "fast_tuner": True, "steps": 20, "auto_sync_first": True,
              "fusion": 4096},
             {"ordering": "auto", "optimizer": "sgd_momentum", "fast_tuner": True, "steps": 18,
              "auto_reducer_first": True},
             {"ordering": "planned", "optimizer": "adam", "steps": 9},
             {"ordering": "planned", "optimizer": "sgd_momentum", "steps": 8, "cross": 0}]
    results = ranks(2, *scenarios(*items), timeout=220)
    check_all(results, exact=True)
    for a, b in zip(results[0], results[1], strict=True):
        tuner_a, tuner_b = a["stats"]["tuner"], b["stats"]["tuner"]
        assert tuner_a["switches"] == tuner_b["switches"], a["scenario"]  # the same decisions, same steps
        assert tuner_a["role"] == "decides" and tuner_b["role"] == "follows"
        assert a["order"] == b["order"], a["scenario"]  # the same pieces in the same order, every step
        assert all(s["applies_from"] == s["decided_at"] + 2 for s in tuner_a["switches"])
        if a["scenario"]["ordering"] == "planned":
            assert a["stats"]["ordering"] == "planned" and a["stats"]["requested_ordering"] == "planned"
            assert [s["plan"] for s in tuner_a["switches"]] == [True] and tuner_a["switches"][0]["decided_at"] == 3
        else:
            changed = [s for s in tuner_a["switches"] if s["settings"] is not None]
            if a["scenario"]["steps"] >= 30:  # its search ends within the steps (at most 3 samples of 3 steps
                # after 4 recorded, then a race of up to 3 and 2 more): the final race's switches are agreed and
                # bitwise too (a drift check after it may start another round on these few noisy steps)
                assert any(h["verdict"].startswith("race: ") for h in tuner_a["history"]), tuner_a["history"]
            assert len(changed) >= 2, tuner_a["switches"]  # the tuner did move between settings
            assert len(tuner_a["history"]) >= 3
            if a["scenario"]["auto_plan"]:  # the planner's plan measured first, then the tuner moved on from it
                assert tuner_a["switches"][0]["plan"] is True and changed[0]["settings"]["ordering"] == "planned"
                assert tuner_a["history"][0]["settings"]["ordering"] == "planned"
                assert any(s["settings"]["ordering"] != "planned" for s in changed[1:]), tuner_a["switches"]
            paths = [s["settings"]["cross_iteration"] for s in changed]
            if a["scenario"]["auto_sync_first"]:  # onto the synchronous path and off it again, bitwise throughout
                assert paths[:2] == [False, True], tuner_a["switches"]
                synchronous, path = [], True  # per step, the path the switches put it on (cross-iteration first)
                for k in range(a["scenario"]["steps"]):
                    path = next((s["settings"]["cross_iteration"] for s in changed if s["applies_from"] == k), path)
                    synchronous.append(not path)
                for r in (a, b):  # p.grad after backward: kept on that path only; after step(): None, as asked
                    assert r["grads_kept"] == synchronous, (r["grads_kept"], tuner_a["switches"])
                    assert not any(r["grads_after_step"]), r["grads_after_step"]
            if a["scenario"]["auto_reducer_first"]:  # torch's reducer (DDP's) for a sample, then commsched again
                assert changed[0]["settings"]["ordering"] == "reducer", tuner_a["switches"]
                assert any(s["settings"]["ordering"] != "reducer" for s in changed[1:]), tuner_a["switches"]
                for r in (a, b):  # the user asked for cross-iteration: p.grad is None after every step()
                    assert not any(r["grads_after_step"]), r["grads_after_step"]
            if not a["scenario"]["cross"]:  # the user's synchronous path is never left
                assert not any(paths), tuner_a["switches"]
