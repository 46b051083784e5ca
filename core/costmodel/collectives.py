"""Closed-form costs of the collectives in the α-β model (pure functions, seconds and bytes).

On one ring of ``n`` ranks over links of latency α and bandwidth β (per direction), a
buffer of ``S`` bytes:

* reduce-scatter and all-gather: ``n − 1`` steps, each moving ``S/n`` over every ring
  edge at once: ``(n−1)·α + (n−1)/n · S/β``;
* all-reduce = reduce-scatter + all-gather: ``2(n−1)·α + 2(n−1)/n · S/β``
  (bandwidth-optimal: Patarasuk & Yuan, 2009).

On a :class:`~commsched.costmodel.topology.Topology` of ``M`` nodes × ``r`` ranks,
``N = M·r``, ``K`` rails (NICs of β_e each per node, rail-aligned rings):

* ``"ring"`` — one flat ring over all ranks in node-major order, cut into ``K``
  rail-aligned rings of ``S/K`` each. Each of the ``2(N−1)`` steps lasts as long as its
  slowest edge: ``max(α_i + S/(N·β_i), α_e + S/(N·K·β_e))`` (an inter term only when
  ``M > 1``, an intra term only when ``r > 1``). Exactly one edge per direction of each
  ring leaves each node, so a node's NICs carry ``2(N−1)/N · S`` per direction.
* ``"hierarchical"`` — intra reduce-scatter (r ranks), inter all-reduce of the ``S/r``
  shard among the M nodes (r concurrent rings, one per local rank, all crossing the
  node's K rails at once, so each gets ``K·β_e/r``), intra all-gather:
  ``2(r−1)α_i + 2(r−1)/r · S/β_i + 2(M−1)α_e + 2(M−1)/M · S/(K·β_e)``; the NICs carry
  ``2(M−1)/M · S`` per direction.

On one node both are the intra ring. Example, 2 nodes × 2 ranks: the flat ring pushes
1.5·S through each NIC, the hierarchical one 1.0·S. Latency: the flat ring pays the
slow link's α on all ``2(N−1)`` steps, the hierarchical one on ``2(M−1)``, so in this
model the hierarchical algorithm is never slower on latency; the flat ring wins when the
intra links are not much faster than the NICs (its phases overlap the two link classes,
the hierarchical phases run one after the other).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commsched.costmodel.topology import Link, Topology

__all__ = [
    "ALGORITHMS",
    "Phase",
    "all_gather_s",
    "allreduce_phases",
    "allreduce_s",
    "best_algorithm",
    "nic_bytes",
    "reduce_scatter_s",
    "ring_allreduce_s",
]

#: The all-reduce algorithms :func:`allreduce_s` knows, in the order ties are broken.
ALGORITHMS = ("ring", "hierarchical")


@dataclass(frozen=True)
class Phase:
    """One phase of a collective: which link classes it occupies and for how long."""

    name: str
    links: tuple[str, ...]  # "intra", "inter", or both for a flat ring spanning nodes
    seconds: float


def _check(n: int, nbytes: float) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"ranks n={n!r} must be a positive integer")
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes={nbytes!r} must be a finite number of bytes >= 0")


def _ring_steps_s(steps: int, n: int, nbytes: float, link: Link) -> float:
    _check(n, nbytes)
    if n == 1 or nbytes == 0:
        return 0.0
    return steps * (link.alpha_s + nbytes / n / link.bandwidth)


def ring_allreduce_s(n: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` among ``n`` ranks: ``2(n−1)α + 2(n−1)/n · S/β`` (0 if n = 1 or S = 0)."""
    return _ring_steps_s(2 * (n - 1), n, nbytes, link)


def reduce_scatter_s(n: int, nbytes: float, link: Link) -> float:
    """Ring reduce-scatter of an ``nbytes`` buffer (each rank keeps S/n): ``(n−1)α + (n−1)/n · S/β``."""
    return _ring_steps_s(n - 1, n, nbytes, link)


def all_gather_s(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather into an ``nbytes`` buffer (each rank brings S/n): ``(n−1)α + (n−1)/n · S/β``."""
    return _ring_steps_s(n - 1, n, nbytes, link)


def _unknown(algorithm: str) -> ValueError:
    return ValueError(f"unknown all-reduce algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def allreduce_phases(topology: Topology, nbytes: float, algorithm: str = "ring") -> tuple[Phase, ...]:
    """The phases of one all-reduce of ``nbytes`` on ``topology`` (formulas in the module docstring),
    the first one carrying ``topology.extra_s[algorithm] + extra_s_per_byte[algorithm] · S``
    (the engine's measured cost beyond α-β; the flat ring's on one node or one rank per node).

    Their ``seconds`` sum to :func:`allreduce_s`; a simulator that models link classes
    as resources holds each phase's ``links`` for its duration. Empty when nothing moves.
    """
    if algorithm not in ALGORITHMS:
        raise _unknown(algorithm)
    _check(topology.world_size, nbytes)
    t, nodes, ranks = topology, topology.nodes, topology.ranks_per_node
    if nbytes == 0 or t.world_size == 1:
        return ()
    phases = _alpha_beta_phases(t, nbytes, algorithm)
    name = algorithm if nodes > 1 and ranks > 1 else "ring"
    extra = t.extra_s.get(name, 0.0) + t.extra_s_per_byte.get(name, 0.0) * nbytes
    if extra:  # the engine's own cost beyond α-β, measured by the probe: on the first phase
        first = phases[0]
        phases = (Phase(first.name, first.links, first.seconds + extra),) + phases[1:]
    return phases


def _alpha_beta_phases(t: Topology, nbytes: float, algorithm: str) -> tuple[Phase, ...]:
    nodes, ranks = t.nodes, t.ranks_per_node
    # K rails in parallel: the node's network bandwidth is K·β_e (rail-aligned rings).
    inter = Link(t.inter.alpha_s, t.inter.bandwidth * t.rails)
    if nodes == 1:
        return (Phase("intra ring all-reduce", ("intra",), ring_allreduce_s(ranks, nbytes, t.intra)),)
    if ranks == 1:
        return (Phase("inter ring all-reduce", ("inter",), ring_allreduce_s(nodes, nbytes, inter)),)
    if algorithm == "ring":
        n = t.world_size
        step = max(t.intra.transfer_s(nbytes / n), inter.transfer_s(nbytes / n))
        return (Phase("flat ring all-reduce", ("intra", "inter"), 2 * (n - 1) * step),)
    return (Phase("intra reduce-scatter", ("intra",), reduce_scatter_s(ranks, nbytes, t.intra)),
            # r shards of S/r at once through K·β_e: the same as one ring of S over K·β_e.
            Phase("inter all-reduce of the shard", ("inter",), ring_allreduce_s(nodes, nbytes, inter)),
            Phase("intra all-gather", ("intra",), all_gather_s(ranks, nbytes, t.intra)))


def allreduce_s(topology: Topology, nbytes: float, algorithm: str = "ring") -> float:
    """Seconds of one all-reduce of ``nbytes`` per rank with ``algorithm`` (``"ring"`` or
    ``"hierarchical"``) on ``topology``; 0 for one rank or no bytes. Non-decreasing in
    ``nbytes``. Unknown algorithm: ``ValueError`` listing the known ones."""
    return sum(phase.seconds for phase in allreduce_phases(topology, nbytes, algorithm))


def nic_bytes(topology: Topology, nbytes: float, algorithm: str = "ring") -> float:
    """Bytes leaving each node through its network link(s) (all rails together), per
    direction, for one all-reduce of ``nbytes``: ``2(N−1)/N · S`` for the flat ring,
    ``2(M−1)/M · S`` for the hierarchical one, 0 on one node."""
    if algorithm not in ALGORITHMS:
        raise _unknown(algorithm)
    _check(topology.world_size, nbytes)
    if topology.nodes == 1:
        return 0.0
    n = topology.world_size if algorithm == "ring" else topology.nodes
    return 2 * (n - 1) / n * nbytes


def best_algorithm(topology: Topology, nbytes: float) -> tuple[str, float]:
    """The fastest algorithm for ``nbytes`` on ``topology`` and its time; ties go to the
    earlier name in :data:`ALGORITHMS` (the flat ring, which needs no sub-groups)."""
    best = min(ALGORITHMS, key=lambda name: (allreduce_s(topology, nbytes, name), ALGORITHMS.index(name)))
    return best, allreduce_s(topology, nbytes, best)
