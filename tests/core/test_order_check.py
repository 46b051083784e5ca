"""The check that ends each fifo step (commsched.order_check): digests, the sum's test, the message."""

from __future__ import annotations

import itertools

import pytest

from commsched import failures
from commsched.errors import OrderAgreementError
from commsched.order_check import StepManifest, agree, describe_difference, digest_values, mismatch, split_lists

STEP = ["head.bias:4:float32", "head.weight:64:float32", "trunk.bias:16:float32", "trunk.weight:256:float32"]


def test_the_digest_changes_with_a_name_a_size_a_dtype_or_the_order_and_stays_exact_in_float64():
    base = digest_values(STEP)
    assert digest_values(list(STEP)) == base  # deterministic (no per-process hash seed)
    variants = [STEP[:1] + ["head.weight:64:bfloat16"] + STEP[2:], STEP[:1] + ["head.weight:65:float32"] + STEP[2:],
                STEP[:1] + ["other.weight:64:float32"] + STEP[2:], [STEP[1], STEP[0], *STEP[2:]], STEP[:-1]]
    for other in variants:
        assert digest_values(other) != base, other
    for values in [base] + [digest_values(v) for v in variants]:
        hi, lo, count = values
        assert all(float(int(v)) == v and 0 <= v < 2**26 for v in (hi, lo))
    assert base[2] == 4.0
    # every permutation of the step gives its own digest (the engine pairs by position)
    assert len({digest_values(list(p)) for p in itertools.permutations(STEP)}) == 24


@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_sum_agrees_only_when_every_rank_had_the_same_step(world):
    own = digest_values(STEP)
    same = [world * v for v in own]
    assert agree(same, own, world)
    other = digest_values(STEP[::-1])
    mixed = [(world - 1) * a + b for a, b in zip(own, other, strict=True)]
    assert not agree(mixed, own, world)  # the ranks with the usual step see it
    assert not agree(mixed, other, world)  # and so does the one that differs
    assert not agree(same[:2], own, world)


def test_the_message_names_the_first_difference_or_the_extra_tensor_or_says_why_it_cannot():
    swapped = STEP[:1] + ["tail.weight:64:float32"] + STEP[2:]
    msg = describe_difference(7, 1, swapped, 0, STEP)
    assert "step 7" in msg and "the 2nd tensor was 'tail.weight' (64 elements of float32) on rank 1" in msg
    assert "'head.weight' (64 elements of float32) on rank 0" in msg and "ordering='dynamic'" in msg
    longer = describe_difference(3, 0, STEP + ["extra.bias:4:float32"], 1, STEP)
    assert "rank 0 submitted 5 tensors, rank 1 4" in longer and "only rank 0 had was 'extra.bias'" in longer
    shorter = describe_difference(3, 0, STEP, 1, STEP + ["extra.bias:4:float32"])
    assert "only rank 1 had was 'extra.bias'" in shorter
    assert "did not arrive" in describe_difference(3, 1, STEP, 0, None)
    assert "another rank differs" in describe_difference(3, 1, STEP, 0, list(STEP))
    assert "the 11th tensor" in describe_difference(0, 0, ["x:1:f"] * 11, 1, ["x:1:f"] * 10 + ["y:1:f"])
    error = mismatch(7, 1, swapped, 0, STEP)
    assert isinstance(error, OrderAgreementError) and str(error) == msg


def test_a_manifest_is_taken_once_per_step_and_lists_travel_as_text():
    m = StepManifest()
    m.add("a.weight", 12, "float32")
    m.add("fused[a..b](2)", 20, "bfloat16")
    assert m.take() == ["a.weight:12:float32", "fused[a..b](2):20:bfloat16"]
    assert m.take() == []
    assert split_lists("\n".join(STEP).encode()) == STEP and split_lists(b"") == []


def test_the_disagreement_found_by_an_update_is_raised_as_itself():
    found = OrderAgreementError("ranks differ")
    assert failures.update_failed("commsched/order-check/3", found) is found
    other = failures.update_failed("w", ValueError("boom"))
    assert "the update after reducing tensor 'w' failed" in str(other) and isinstance(other.__cause__, ValueError)
