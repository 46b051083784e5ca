"""The seed's slack priority (commsched.costmodel.slack): its definitions against a hand
computation, α = 0 is layer order, and on one link it never beats layer order (earliest due
date) in the simulator — where it moves layers it loses, as theory says."""

from __future__ import annotations

import pytest

from commsched import SchedulerConfig
from commsched.costmodel.collectives import allreduce_s
from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec
from commsched.costmodel.simulator import SimSettings, parse_sim_strategy, simulate
from commsched.costmodel.slack import slack_order
from commsched.costmodel.topology import Link, Topology

MB = 1 << 20


def flat(world: int = 2, bandwidth: float = 125e6) -> Topology:
    link = Link(alpha_s=0.0, bandwidth=bandwidth)
    return Topology(nodes=world, ranks_per_node=1, intra=link, inter=link)


def comm_heavy_like() -> Profile:
    """Small first layers, three 16 MB layers ready early in backward, a medium head: the shape of
    the bench's comm-heavy workload, where the rule moves a big early-ready layer to the front."""
    sizes = [0.004, 0.07, 0.3, 16, 16, 16, 0.8]
    layers = tuple(LayerProfile(name=f"l{i}", forward_s=0.03, backward_s=0.04, apply_s=0.002,
                                tensors=(TensorSpec(f"l{i}.w", int(mb * MB) // 4, 4),))
                   for i, mb in enumerate(sizes))
    return Profile(layers=layers, per_piece_cpu_s=0.0)


def test_due_ready_ahead_and_slack_are_the_documented_sums():
    prof, topo = comm_heavy_like(), flat()
    order = slack_order(prof, topo, alpha=1.0, floor_s=1e-4)
    comm = [allreduce_s(topo, layer.grad_bytes, "ring") for layer in prof.layers]
    ready = prof.ready_times()
    for i in range(len(prof.layers)):
        due = prof.backward_s + sum(layer.apply_s + layer.forward_s for layer in prof.layers[:i])
        assert order.due_s[i] == pytest.approx(due)
        assert order.ready_s[i] == pytest.approx(ready[i])
        assert order.ahead_s[i] == pytest.approx(sum(comm[: i + 1]))
        assert order.slack_s[i] == pytest.approx(max(1e-4, due - ready[i] - sum(comm[: i + 1])))
    assert sorted(order.layer_order) == list(range(len(prof.layers)))
    # priorities follow the layer order the rule chose, one per tensor
    by_priority = sorted(order.tensor_priority, key=order.tensor_priority.get)
    assert by_priority == [f"l{li}.w" for li in order.layer_order]


def test_alpha_zero_is_layer_order():
    order = slack_order(comm_heavy_like(), flat(), alpha=0.0)
    assert order.layer_order == tuple(range(7)) and order.moved == 0
    assert simulate(comm_heavy_like(), flat(), "slack", SimSettings(slack_alpha=0.0)).step_time_s == \
        pytest.approx(simulate(comm_heavy_like(), flat(), "dynamic").step_time_s, rel=1e-12)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 4.0, 16.0])
def test_on_one_link_the_rule_never_beats_earliest_due_date_and_loses_where_it_moves_layers(alpha):
    prof, topo = comm_heavy_like(), flat()
    order = slack_order(prof, topo, alpha)
    assert order.moved > 0, "the rule should move the big early-ready layer on this profile"
    dynamic = simulate(prof, topo, "dynamic").step_time_s
    slack = simulate(prof, topo, "slack", SimSettings(slack_alpha=alpha)).step_time_s
    assert slack > dynamic * 1.01, (slack, dynamic)


def test_bad_alpha_and_the_config_fields():
    with pytest.raises(ValueError, match="slack_alpha=-1"):
        slack_order(comm_heavy_like(), flat(), alpha=-1)
    assert parse_sim_strategy("slack").priority == "slack"
    assert SchedulerConfig(priority="Slack").priority == "slack"
    assert SchedulerConfig().priority == "layer" and SchedulerConfig().slack_alpha == 1.0
    with pytest.raises(ValueError, match="priority='slack' ranks the pieces rank 0 decides"):
        SchedulerConfig(priority="slack", ordering="static")
    with pytest.raises(ValueError, match="priority='edd' is not a known priority rule; use one of layer, slack"):
        SchedulerConfig(priority="edd")
    with pytest.raises(ValueError, match="slack_alpha=nan must be a finite number >= 0"):
        SchedulerConfig(slack_alpha=float("nan"))


def test_the_environment_sets_the_priority(monkeypatch):
    monkeypatch.setenv("COMMSCHED_PRIORITY", "slack")
    monkeypatch.setenv("COMMSCHED_SLACK_ALPHA", "2.5")
    config = SchedulerConfig()
    assert (config.priority, config.slack_alpha) == ("slack", 2.5)
