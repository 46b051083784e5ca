"""The scheduler's invariants under random workloads (hypothesis), ranks as threads.

Each example: 2-5 ranks on an :class:`InProcessWorld` (instant or finite link), a
few tensors of random sizes, dtypes and priorities, a random partition size and credit, 1-3 steps with
``mark_step()``, and per-rank seeded random sleeps before each submission to
perturb readiness (they only shuffle timing; nothing waits on them). Checked:

1. credit: bytes in flight never exceed the credit, except one piece larger than
   the credit alone -- from the scheduler's stats, the engine's own count and, on
   the deciding rank, at every decision;
2. priority: each piece rank 0 starts has the smallest (step, priority,
   submission) key among the ready pieces, with the priority the test submitted;
3. agreement: every rank starts the same sequence (``world.issued``) and the
   engine saw no mismatch; with ``static`` every later step repeats step 0's order;
4. exactly once: every piece is started once per step on every rank and every
   element holds the exact sum of the ranks' contributions (a second reduction
   would multiply it by the world size, a missing one leave a single rank's value);
5. every future resolves to its tensor; nothing hangs (a join timeout and the
   test timeout).
"""

from __future__ import annotations

import array
import collections
import os
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commsched import SchedulerConfig
from commsched.partition import piece_bounds

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]

MAX_DELAY_S = 0.001


@st.composite
def workloads(draw, ordering: str):
    world_size = draw(st.integers(2, 5))
    n_tensors = draw(st.integers(1, 6))
    tensors = [
        {"name": f"t{i}", "numel": draw(st.integers(0, 24)), "typecode": draw(st.sampled_from("hifd")),
         "priority": draw(st.integers(0, 3))}
        for i in range(n_tensors)
    ]
    steps = draw(st.integers(1, 3))
    names = [t["name"] for t in tensors]
    per_step_names = []
    for _ in range(steps):
        if ordering == "dynamic":  # dynamic allows a different set of tensors per step (same on every rank)
            subset = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
        else:  # static needs the same tensors every step
            subset = list(names)
        per_step_names.append(subset)
    # Submission order per rank and step: readiness differs per rank, except that fifo needs the
    # same order everywhere (it is only for engines that agree on order, or orders that agree by construction).
    orders = []
    for step in range(steps):
        if ordering == "fifo":
            shared = draw(st.permutations(per_step_names[step]))
            orders.append([list(shared)] * world_size)
        else:
            orders.append([list(draw(st.permutations(per_step_names[step]))) for _ in range(world_size)])
    return {
        "world_size": world_size,
        "tensors": {t["name"]: t for t in tensors},
        "orders": orders,  # orders[step][rank] = names in submission order
        "partition_bytes": draw(st.integers(4, 48)),
        "credit_bytes": draw(st.integers(4, 96)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        # a finite link keeps pieces in flight, so the credit binds (None: instant link)
        "bandwidth": draw(st.sampled_from([None, 2e5, 1e6])),
    }


def contribution(rank: int, step: int, index: int) -> int:
    return (rank + 1) * (1 + index % 3) + step


def expected_sum(world_size: int, step: int, index: int) -> int:
    return sum(contribution(r, step, index) for r in range(world_size))


def run_workload(ranks, wl: dict, ordering: str) -> None:
    world_size = wl["world_size"]
    specs = wl["tensors"]
    steps = len(wl["orders"])
    config = SchedulerConfig(partition_bytes=wl["partition_bytes"], credit_bytes=wl["credit_bytes"],
                             ordering=ordering, timeout_s=20)
    decisions: list[dict] = []

    def observe(piece, waiting, in_flight_bytes) -> None:  # rank 0's decisions, as they are made
        decisions.append({"piece": piece, "key": piece.key, "waiting": waiting, "in_flight_bytes": in_flight_bytes})

    submitted_keys: dict[tuple[int, str], tuple[int, int]] = {}  # rank 0: (step, piece name) -> (priority, seq)

    def body(rank: int, scheduler):
        rng = random.Random(wl["seed"] * 7 + rank)
        futures, tensors = [], {}
        seq = 0
        for step in range(steps):
            for name in wl["orders"][step][rank]:
                spec = specs[name]
                time.sleep(rng.random() * MAX_DELAY_S)  # perturbs readiness only
                tensor = array.array(spec["typecode"], [contribution(rank, step, i) for i in range(spec["numel"])])
                tensors[(step, name)] = tensor
                if rank == 0:
                    submitted_keys[(step, name)] = (spec["priority"], seq)
                futures.append((tensor, scheduler.submit(name, tensor, priority=spec["priority"])))
                seq += 1
            assert scheduler.mark_step() == step + 1
        scheduler.synchronize(timeout=15)
        for tensor, future in futures:
            assert future.done()
            assert future.result(timeout=0) is tensor
        return tensors, scheduler.stats()

    run = ranks(world_size, body, config=config, observers={0: observe}, bandwidth_bytes_per_s=wl.get("bandwidth"))
    run.raise_first()
    assert run.close_errors == [None] * world_size
    world = run.world

    # --- exactly once, by value
    for rank in range(world_size):
        tensors, _ = run.results[rank]
        for (step, name), tensor in tensors.items():
            expected = [expected_sum(world_size, step, i) for i in range(len(tensor))]
            assert list(tensor) == expected, f"rank {rank} step {step} {name}"

    # --- exactly once, by count; identical order on every rank
    expected_pieces = collections.Counter()
    piece_bytes = {}
    step_pieces: list[list[str]] = []
    for step in range(steps):
        names = []
        for name in wl["orders"][step][0]:
            spec = specs[name]
            itemsize = array.array(spec["typecode"]).itemsize
            for index, (lo, hi) in enumerate(piece_bounds(spec["numel"], itemsize, wl["partition_bytes"])):
                names.append(f"{name}#{index}")
                piece_bytes[f"{name}#{index}"] = (hi - lo) * itemsize
        expected_pieces.update(names)
        step_pieces.append(names)
    assert world.mismatches == []
    for rank in range(world_size):
        assert collections.Counter(world.issued[rank]) == expected_pieces, f"rank {rank}"
        assert world.issued[rank] == world.issued[0], f"rank {rank} issued in another order than rank 0"
        assert run.results[rank][1]["pieces"] == sum(expected_pieces.values())

    # --- static: every later step repeats step 0's order
    if ordering == "static":
        issued = world.issued[0]
        n0 = len(step_pieces[0])
        plan = issued[:n0]
        for step in range(1, steps):
            assert issued[step * n0:(step + 1) * n0] == plan, f"step {step} left the static plan"

    # --- credit: engine count, scheduler stats, and every decision of the deciding rank
    credit = wl["credit_bytes"]
    largest = max(piece_bytes.values(), default=0)
    bound = max(credit, largest)
    for rank in range(world_size):
        assert world.max_in_flight_bytes[rank] <= bound
        assert run.results[rank][1]["max_in_flight_bytes"] <= bound
        if largest <= credit:
            assert world.max_in_flight_bytes[rank] <= credit
    for d in decisions:
        assert d["in_flight_bytes"] <= credit or d["in_flight_bytes"] == d["piece"].nbytes, d

    # --- priority on the deciding rank (dynamic always, static in its profiling step)
    for d in decisions:
        piece = d["piece"]
        step = piece.task.step
        priority, seq = submitted_keys[(step, piece.task.name)]
        assert d["key"] == (step, priority, seq, piece.index), "the scheduler used another key than submitted"
        assert all(d["key"] < other for other in d["waiting"]), (
            f"{piece.name} (key {d['key']}) started while a more urgent piece was ready: {sorted(d['waiting'])[:3]}")
    if ordering == "dynamic":
        assert len(decisions) == sum(expected_pieces.values())


# A few examples keep the suite fast; COMMSCHED_TEST_EXAMPLES=500 hunts for rare interleavings.
EXAMPLES = int(os.environ.get("COMMSCHED_TEST_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(wl=workloads("dynamic"))
def test_dynamic_ordering_keeps_credit_priority_agreement_and_exactly_once(ranks, wl):
    run_workload(ranks, wl, "dynamic")


@SETTINGS
@given(wl=workloads("static"))
def test_static_ordering_keeps_credit_agreement_and_exactly_once_and_repeats_the_plan(ranks, wl):
    run_workload(ranks, wl, "static")


@SETTINGS
@given(wl=workloads("fifo"))
def test_fifo_ordering_with_identical_submission_order_keeps_credit_and_exactly_once(ranks, wl):
    run_workload(ranks, wl, "fifo")
