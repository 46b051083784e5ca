"""``--strategies`` parsing (framework-free): the commsched kinds, planned and hierarchical included."""

from __future__ import annotations

import pytest

from commsched.bench.spec import parse_strategies


def test_planned_and_hierarchical_are_commsched_strategies():
    specs = parse_strategies("ddp,dynamic,planned,hierarchical")
    assert [s.kind for s in specs] == ["ddp", "dynamic", "planned", "hierarchical"]
    assert [s.is_commsched for s in specs] == [False, True, True, True]


def test_an_unknown_strategy_names_the_known_ones():
    with pytest.raises(ValueError, match="planned, hierarchical, slack or allreduce"):
        parse_strategies("plannedd")


def test_auto_is_a_commsched_strategy():
    from commsched.bench.spec import parse_strategies

    (spec,) = parse_strategies("auto")
    assert spec.kind == "auto" and spec.is_commsched


def test_slack_is_a_commsched_strategy():
    (spec,) = parse_strategies("slack")
    assert spec.kind == "slack" and spec.is_commsched


def test_the_auto_warm_up_runs_while_the_tuner_searches_by_what_every_rank_knows():
    """The bench warms ``auto`` up until its tuner settles: judged from the agreed decisions (next and
    pending decision, switches), which every rank has alike, never from rank 0's private phase."""
    pytest.importorskip("torch")
    from commsched.plugins.torch.bench.worker import thread_cpu_delta, tuning
    from commsched.plugins.torch.optimizer import TUNER_OPTIONS

    class Opt:
        def __init__(self, steps, **tuner):
            self._stats = {"steps": steps, "tuner": {"switches": [], "next_decision": None,
                                                     "pending_decision": None, **tuner}}

        def stats(self):
            return self._stats
    sample = TUNER_OPTIONS["settle"] + TUNER_OPTIONS["sample_steps"]
    assert tuning(Opt(1, next_decision=3))  # recording the first steps
    assert tuning(Opt(4, pending_decision=3))  # a decision taken, read at the next step
    assert tuning(Opt(11, next_decision=11 + sample - 1, switches=[{}]))  # a sample runs
    assert not tuning(Opt(30, next_decision=30 + TUNER_OPTIONS["check_every"], switches=[{}]))  # settled
    assert not tuning(Opt(30, switches=[{}]))  # no more decisions
    # scheduler threads replaced by a switch: counted thread by thread, never negative
    assert thread_cpu_delta({("dispatch", 1): 5.0}, {("dispatch", 2): 0.25}) == {"dispatch": 0.25}
