"""The offline replay (commsched.replay) keeps the scheduler's invariants.

Each property is checked against the plan's own modelled times by code that
does not share the replay's loop: exactly-once coverage, the credit and slot
limits, priority among ready pieces, work conservation, determinism.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.partition import piece_bounds
from commsched.replay import CostModel, PlanTensor, backward_ready_times, plan

# The replay compares modelled times exactly; so do the checks.
EPS = 0.0


@st.composite
def problems(draw):
    n = draw(st.integers(1, 8))
    tensors = []
    for i in range(n):
        tensors.append(PlanTensor(
            name=f"t{i}",
            numel=draw(st.integers(0, 300)),
            element_size=draw(st.sampled_from([1, 2, 4, 8])),
            priority=draw(st.integers(0, 4)),  # collisions exercise stable ties
            ready=draw(st.sampled_from([0.0, 1e-6, 5e-6, 2e-5])) * draw(st.integers(0, 5)),
        ))
    partition = draw(st.integers(1, 400))
    credit = draw(st.integers(1, 1200))
    slots = draw(st.one_of(st.none(), st.integers(1, 5)))
    ordering = draw(st.sampled_from(["dynamic", "static", "fifo"]))
    cost = CostModel(link_bytes_per_s=draw(st.sampled_from([1e6, 1e7, 1e8])),
                     latency_s=draw(st.sampled_from([0.0, 1e-6, 1e-5])),
                     backward_bytes_per_s=1e7)
    return tensors, partition, credit, slots, ordering, cost


def _in_flight_at(pieces, t):
    """Pieces that started at or before ``t`` and are not finished at ``t``."""
    return [p for p in pieces if p.issue <= t + EPS and p.finish > t + EPS]


@settings(max_examples=120, deadline=None)
@given(problems())
def test_every_piece_is_planned_exactly_once_with_the_schedulers_bounds(problem):
    tensors, partition, credit, slots, ordering, cost = problem
    result = plan(tensors, partition, credit, slots=slots, ordering=ordering, cost=cost)
    names = result.order
    assert len(names) == len(set(names))
    for i, t in enumerate(tensors):
        mine = sorted((p for p in result.pieces if p.tensor == i), key=lambda p: p.index)
        assert [(p.start, p.stop) for p in mine] == piece_bounds(t.numel, t.element_size, partition)
        assert [p.name for p in mine] == [f"{t.name}#{k}" for k in range(len(mine))]
        assert all(p.nbytes == (p.stop - p.start) * t.element_size for p in mine)
        assert result.by_tensor(len(tensors))[i] == mine


@settings(max_examples=120, deadline=None)
@given(problems())
def test_credit_and_slots_are_never_exceeded(problem):
    tensors, partition, credit, slots, ordering, cost = problem
    result = plan(tensors, partition, credit, slots=slots, ordering=ordering, cost=cost)
    for p in result.pieces:
        flying = _in_flight_at(result.pieces, p.issue)
        total = sum(q.nbytes for q in flying)
        # One piece larger than the credit may go alone.
        assert total <= credit or flying == [p], (p.name, total, credit)
        if slots is not None:
            assert len(flying) <= slots
            assert 0 <= p.slot < slots
        else:
            assert p.slot == -1
    if slots is not None:  # a slot is a chain: its next piece starts after the previous ends
        for s in range(slots):
            chain = [p for p in result.pieces if p.slot == s]
            for before, after in zip(chain, chain[1:], strict=False):
                assert after.issue + EPS >= before.finish


@settings(max_examples=120, deadline=None)
@given(problems())
def test_most_urgent_ready_piece_starts_first_and_ties_are_stable(problem):
    tensors, partition, credit, slots, ordering, cost = problem
    result = plan(tensors, partition, credit, slots=slots, ordering=ordering, cost=cost)

    def key(p):
        return (p.seq, p.index) if ordering == "fifo" else (p.priority, p.seq, p.index)

    # seq is the order in which tensors became ready, ties by list position.
    by_ready = sorted(range(len(tensors)), key=lambda i: (tensors[i].ready, i))
    for p in result.pieces:
        assert p.seq == by_ready.index(p.tensor)
        assert p.issue + EPS >= p.ready
    for k, p in enumerate(result.pieces):
        later = result.pieces[k + 1:]
        waiting = [q for q in later if q.ready <= p.issue + EPS]
        assert all(key(q) > key(p) for q in waiting), (p.name, [q.name for q in waiting])


@settings(max_examples=80, deadline=None)
@given(problems())
def test_queue_never_idles_while_the_head_fits(problem):
    tensors, partition, credit, slots, ordering, cost = problem
    result = plan(tensors, partition, credit, slots=slots, ordering=ordering, cost=cost)
    # At each moment something becomes ready or finishes, the most urgent ready piece
    # either starts then or is blocked by the credit or the slots.
    events = sorted({p.ready for p in result.pieces} | {p.finish for p in result.pieces})
    for t in events:
        waiting = [p for p in result.pieces if p.ready <= t + EPS and p.issue > t + EPS]
        if not waiting:
            continue
        head = min(waiting, key=lambda p: (p.seq, p.index) if ordering == "fifo" else p.key)
        flying = _in_flight_at(result.pieces, t)
        in_bytes = sum(q.nbytes for q in flying)
        blocked = (in_bytes + head.nbytes > credit and in_bytes > 0) or (slots is not None and len(flying) >= slots)
        assert blocked, (t, head.name, in_bytes, len(flying))


@settings(max_examples=50, deadline=None)
@given(problems())
def test_plan_is_a_pure_function_of_its_arguments(problem):
    tensors, partition, credit, slots, ordering, cost = problem
    assert plan(tensors, partition, credit, slots=slots, ordering=ordering, cost=cost) == \
        plan(list(tensors), partition, credit, slots=slots, ordering=ordering, cost=cost)


def test_readiness_interleaves_with_priority_so_pieces_flow_during_backward():
    # Four layers in forward order; backward produces layer 3 first.
    # The link is 4x slower than backward, so pieces queue up.
    cost = CostModel(link_bytes_per_s=2.5e7, backward_bytes_per_s=1e8)
    sizes = [4 << 20, 4 << 20, 4 << 20, 4 << 20]
    ready = backward_ready_times(sizes, cost)
    assert ready == sorted(ready, reverse=True)
    tensors = [PlanTensor(f"layer{i}", sizes[i] // 4, 4, priority=i, ready=ready[i]) for i in range(4)]
    result = plan(tensors, 1 << 20, 2 << 20, slots=2, cost=cost)
    # The first piece goes as soon as the first gradient exists, long before backward ends...
    assert result.pieces[0].issue == pytest.approx(min(ready))
    assert result.pieces[0].name == "layer3#0"
    # ...and once layer 0 is ready it overtakes every queued piece of later layers.
    after = [p for p in result.pieces if p.issue >= ready[0]]
    assert [p.name for p in after[:4]] == [f"layer0#{k}" for k in range(4)]
    assert any(p.priority > 0 for p in after[4:])  # later layers were still queued


def test_fifo_follows_ready_order():
    tensors = [PlanTensor(f"t{i}", 10, 4, priority=i, ready=float(3 - i)) for i in range(3)]
    result = plan(tensors, 40, 40, ordering="fifo")
    assert result.order == ["t2#0", "t1#0", "t0#0"]


def test_bad_arguments_raise_with_the_fix():
    with pytest.raises(ValueError, match="ordering"):
        plan([], 1, 1, ordering="random")
    with pytest.raises(ValueError, match="slots"):
        plan([], 1, 1, slots=0)
    with pytest.raises(ValueError, match="positive"):
        plan([], 0, 1)
    with pytest.raises(ValueError, match="CostModel"):
        CostModel(link_bytes_per_s=0)


def test_a_plan_of_priority_order_replays_its_pieces_by_priority_not_as_listed():
    # TensorFlow writes the replay's order into its graph: a plan whose order is 'priority' gets the
    # order dynamic's rule gives its pieces (the plan's cut), not the order it lists
    from commsched.plan import Plan, PlanGroup, PlannedPiece, PlannedTensor

    model = (PlannedTensor("a", 12, 4), PlannedTensor("b", 8, 4))
    groups = (PlanGroup("a", ("a",), 16), PlanGroup("b", ("b",), 32))
    listed = (PlannedPiece("b", 0), PlannedPiece("a", 2), PlannedPiece("a", 1), PlannedPiece("a", 0))
    tensors = [PlanTensor("a", 12, 4, priority=0, ready=1.0), PlanTensor("b", 8, 4, priority=1, ready=0.0)]
    fixed = Plan(model=model, groups=groups, pieces=listed, credit_bytes=1 << 20)
    by_priority = Plan(model=model, groups=groups, pieces=listed, credit_bytes=1 << 20, order="priority")
    assert plan(tensors, 1 << 20, 1 << 20, ordering="planned", plan=fixed).order == \
        ["b#0", "a#2", "a#1", "a#0"]
    # b is ready first and goes; then a's pieces in index order (the plan's 16 B cut)
    assert plan(tensors, 1 << 20, 1 << 20, ordering="planned", plan=by_priority).order == \
        ["b#0", "a#0", "a#1", "a#2"]


@settings(max_examples=120, deadline=None)
@given(problems(), st.booleans(), st.sampled_from([0.0, 1e-6, 1e-5, 1.0]))
def test_a_graphs_replay_keeps_coverage_credit_and_chains(problem, shared, lookahead):
    # shared_link and lookahead_s (TensorFlow's graph plans) change when pieces go, never what goes
    tensors, partition, credit, slots, ordering, cost = problem
    result = plan(tensors, partition, credit, slots=slots, ordering=ordering, cost=cost, shared_link=shared,
                  lookahead_s=lookahead)
    names = sorted(p.name for p in result.pieces)
    assert names == sorted(p.name for p in plan(tensors, partition, credit, slots=slots, ordering=ordering,
                                                  cost=cost).pieces)
    for p in result.pieces:
        assert p.ready <= p.issue <= p.finish
        flying = _in_flight_at(result.pieces, p.issue)
        assert sum(q.nbytes for q in flying) <= credit or flying == [p]
        if slots is not None:
            assert len(flying) <= slots
    if slots is not None:
        for s in range(slots):
            chain = [p for p in result.pieces if p.slot == s]
            for before, after in zip(chain, chain[1:], strict=False):
                assert after.issue + EPS >= before.finish


def test_on_a_shared_link_pieces_in_flight_split_the_rate():
    cost = CostModel(link_bytes_per_s=100.0, latency_s=0.0)
    tensors = [PlanTensor("a", 100, 1, priority=0, ready=0.0), PlanTensor("b", 100, 1, priority=1, ready=0.0)]
    serial = plan(tensors, 100, 1000, slots=2, cost=cost)
    shared = plan(tensors, 100, 1000, slots=2, cost=cost, shared_link=True)
    assert [p.finish for p in serial.pieces] == [1.0, 2.0]  # one after the other
    assert [p.finish for p in shared.pieces] == [pytest.approx(2.0), pytest.approx(2.0)]  # together, at half rate


def _mlp(backward_bytes_per_s):
    """The TF benchmark's MLP: a 1 MiB first kernel, then four 4 MiB kernels (forward order)."""
    sizes = [1 << 20] + [4 << 20] * 4
    cost = CostModel(backward_bytes_per_s=backward_bytes_per_s)
    ready = backward_ready_times(sizes, cost)
    return [PlanTensor(f"d{i}", s // 4, 4, priority=i, ready=ready[i]) for i, s in enumerate(sizes)], cost


def test_lookahead_keeps_a_chain_for_the_first_layer_when_backward_is_short():
    # Gradients ready within the credit's link time (backward 5x the link, as measured on TF): without
    # the lookahead the first layer's kernel is planned behind the last hidden layer's on its chain, and
    # on a graph it waits for that kernel's *completion*; with it, the least urgent kernel waits instead.
    from commsched.replay import graph_lookahead_s

    tensors, cost = _mlp(6.25e8)
    window = graph_lookahead_s(16 << 20, cost)
    assert window == pytest.approx((16 << 20) / cost.link_bytes_per_s)
    greedy = plan(tensors, 4 << 20, 16 << 20, slots=4, cost=cost, shared_link=True)
    held = plan(tensors, 4 << 20, 16 << 20, slots=4, cost=cost, shared_link=True, lookahead_s=window)

    def before_on_its_chain(result, name):
        mine = next(p for p in result.pieces if p.name == name)
        chain = [p.name for p in result.pieces if p.slot == mine.slot]
        return chain[:chain.index(name)]

    assert before_on_its_chain(greedy, "d0#0") == ["d4#0"]
    assert before_on_its_chain(held, "d0#0") == []
    assert before_on_its_chain(held, "d4#0") == ["d0#0"]  # the least urgent one waits
    for name in ("d1#0", "d2#0", "d3#0"):
        assert before_on_its_chain(held, name) == []


def test_lookahead_changes_nothing_when_backward_is_longer_than_the_window():
    # backward 10x slower than the link: the urgent pieces arrive long after the window; work-conserving
    tensors, cost = _mlp(1.25e7)
    greedy = plan(tensors, 4 << 20, 16 << 20, slots=4, cost=cost, shared_link=True)
    held = plan(tensors, 4 << 20, 16 << 20, slots=4, cost=cost, shared_link=True, lookahead_s=0.134)
    assert [(p.name, p.slot, p.issue) for p in held.pieces] == [(p.name, p.slot, p.issue) for p in greedy.pieces]
    with pytest.raises(ValueError, match="lookahead_s"):
        plan(tensors, 4 << 20, 16 << 20, slots=4, lookahead_s=-1.0)


@pytest.mark.timeout(20)
def test_a_shared_link_ends_pieces_whatever_the_clocks_rounding():
    # at t = 1e9 s a 1-byte piece's share of the link is below the clock's resolution: the piece still
    # ends at its event (an earlier version looped for ever here)
    for ready in (1e9, 1e12):
        tensors = [PlanTensor("a", 1, 1, priority=0, ready=ready), PlanTensor("b", 3, 1, priority=1, ready=ready)]
        result = plan(tensors, 1, 10, slots=2, cost=CostModel(link_bytes_per_s=1e8, latency_s=0.0), shared_link=True)
        assert sorted(p.name for p in result.pieces) == ["a#0", "b#0", "b#1", "b#2"]
        assert all(p.finish >= p.issue >= ready for p in result.pieces)
