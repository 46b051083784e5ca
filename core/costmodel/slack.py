"""The seed's slack priority: ``Priority(b) = LayerIndex(i) + α · 1/SlackTimeToNextForward(i)``.

``dynamic`` sends the ready piece of the earliest layer first (layer order, i.e. earliest due
date: the next forward needs layer 0 first). The seed proposes to add an urgency term that grows
as a layer's *slack* shrinks. This module computes that order from the cost model, once, from a
profile and a topology; the runtime then uses it in place of layer order (``SchedulerConfig(
priority="slack")``) and the simulator scores it (``SimSettings(priority="slack")``).

Definitions, for layer ``i`` in forward order (``0`` first), on one step of the profile:

- due ``d_i``: when the next forward needs layer ``i``'s reduced gradients, from the start of
  backward: ``backward_s + step_overhead_s + Σ_{j<i} (apply_j + forward_j)`` (the next
  forward applies and runs the layers before ``i`` first);
- ready ``r_i``: when its gradients are ready (``Profile.ready_times()``);
- communication ahead ``A_i``: the all-reduce time of every tensor of layers ``0..i``
  (with layer-order priority they go before or with ``i``; all of them are ready no earlier
  than ``r_i``, since backward produces the earlier layers later);
- slack ``s_i = d_i − r_i − A_i``, floored at ``floor_s`` (a layer that cannot make its due
  time anyway is as urgent as the floor says, never "infinitely" urgent).

The seed writes the formula with a larger priority sent first and the layer index counted
from the output. In commsched smaller keys go first and layer 0 is the input layer, so the
same rule is ``key_i = i − α · c̄ / s_i``, with ``c̄`` the mean all-reduce time of a layer:
``α`` is dimensionless (α = 1: a layer whose slack equals one average layer's communication
moves one place ahead). Keys are turned into ranks 0..L−1 (ties keep layer order), which is
what the scheduler's integer priorities take.

Theory: on one bottleneck link, earliest-due-date order with preemption at piece boundaries
minimises the worst lateness (Jackson's rule; the simulator's unit test checks it), and the due
dates here are increasing in ``i``, so layer order *is* EDD. Slack order is least-laxity
first, which is not optimal on one machine; it can only differ from EDD where ``α`` is large
enough to swap layers, and then it can only tie or lose on a single link. It may differ on a
two-level topology or with a multi-piece credit where several links are busy at once.
``docs/tuning.md`` reports what was measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commsched.costmodel.collectives import allreduce_s
from commsched.costmodel.profile import Profile
from commsched.costmodel.topology import Topology

__all__ = ["PRIORITIES", "SlackOrder", "slack_order"]

#: How ``dynamic`` ranks ready pieces: ``layer`` (first use in forward: earliest due date) or ``slack``.
PRIORITIES = ("layer", "slack")


@dataclass(frozen=True)
class SlackOrder:
    """The slack rule's result for one profile on one topology."""

    alpha: float
    #: per layer (forward order): due, ready, communication ahead and slack (seconds)
    due_s: tuple[float, ...]
    ready_s: tuple[float, ...]
    ahead_s: tuple[float, ...]
    slack_s: tuple[float, ...]
    #: the layers in the order the rule sends them (a permutation of 0..L-1)
    layer_order: tuple[int, ...]
    #: per tensor name: its priority (smaller first), consistent with ``layer_order``
    tensor_priority: dict[str, int]

    @property
    def moved(self) -> int:
        """How many layers are not where layer order puts them (0: the rule is layer order)."""
        return sum(1 for place, li in enumerate(self.layer_order) if place != li)


def slack_order(profile: Profile, topology: Topology, alpha: float = 1.0, *, floor_s: float = 1e-4,
                algorithm: str = "ring") -> SlackOrder:
    """The slack priorities of ``profile``'s tensors on ``topology`` (see the module docstring)."""
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"slack_alpha={alpha!r} must be a finite number >= 0 (0 is plain layer order)")
    if not floor_s > 0:
        raise ValueError(f"floor_s={floor_s!r} must be > 0 seconds")
    layers = profile.layers
    world = topology.world_size
    comm = [sum(allreduce_s(topology, t.nbytes, algorithm) for t in layer.tensors) if world > 1 else 0.0
            for layer in layers]
    ready = profile.ready_times()
    due, ahead, slack = [], [], []
    start = profile.backward_s + profile.step_overhead_s
    running = 0.0
    for i, layer in enumerate(layers):
        due.append(start)
        start += layer.apply_s + layer.forward_s
        running += comm[i]
        ahead.append(running)
        slack.append(max(floor_s, due[i] - ready[i] - running))
    with_comm = [c for c in comm if c > 0]
    mean_comm = sum(with_comm) / len(with_comm) if with_comm else 0.0
    keys = [i - alpha * mean_comm / slack[i] for i in range(len(layers))]
    order = tuple(sorted(range(len(layers)), key=lambda i: (keys[i], i)))
    priority: dict[str, int] = {}
    counter = 0
    for li in order:
        for t in layers[li].tensors:
            if t.name not in priority:  # a tied tensor keeps its first (most urgent) place
                priority[t.name] = counter
                counter += 1
    return SlackOrder(alpha=float(alpha), due_s=tuple(due), ready_s=tuple(ready), ahead_s=tuple(ahead),
                      slack_s=tuple(slack), layer_order=order, tensor_priority=priority)
