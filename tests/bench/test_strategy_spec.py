"""``--strategies`` parsing (framework-free): the commsched kinds, planned and hierarchical included."""

from __future__ import annotations

import pytest

from commsched.bench.spec import parse_strategies


def test_planned_and_hierarchical_are_commsched_strategies():
    specs = parse_strategies("ddp,dynamic,planned,hierarchical")
    assert [s.kind for s in specs] == ["ddp", "dynamic", "planned", "hierarchical"]
    assert [s.is_commsched for s in specs] == [False, True, True, True]


def test_an_unknown_strategy_names_the_known_ones():
    with pytest.raises(ValueError, match="planned, hierarchical or allreduce"):
        parse_strategies("plannedd")


def test_auto_is_a_commsched_strategy():
    from commsched.bench.spec import parse_strategies

    (spec,) = parse_strategies("auto")
    assert spec.kind == "auto" and spec.is_commsched
