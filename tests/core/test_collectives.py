"""Collective costs against their closed forms, and the two-level claims of the issue."""

import pytest

from commsched.costmodel.collectives import (
    ALGORITHMS,
    all_gather_s,
    allreduce_phases,
    allreduce_s,
    best_algorithm,
    nic_bytes,
    reduce_scatter_s,
    ring_allreduce_s,
)
from commsched.costmodel.topology import Link, Topology

pytestmark = pytest.mark.timeout(60)

MB = 1e6


@pytest.mark.parametrize("n", [2, 3, 4, 8, 128])
def test_ring_allreduce_matches_the_closed_form(n):
    link = Link(alpha_s=5e-6, bandwidth=12.5e9)
    size = 64 * MB
    expected = 2 * (n - 1) * 5e-6 + 2 * (n - 1) / n * size / 12.5e9
    assert ring_allreduce_s(n, size, link) == pytest.approx(expected, rel=1e-12)
    half = (n - 1) * 5e-6 + (n - 1) / n * size / 12.5e9
    assert reduce_scatter_s(n, size, link) == pytest.approx(half, rel=1e-12)
    assert all_gather_s(n, size, link) == pytest.approx(half, rel=1e-12)


def test_nothing_to_reduce_costs_nothing():
    link = Link(1e-3, 1e6)
    assert ring_allreduce_s(1, 10 * MB, link) == 0.0
    assert ring_allreduce_s(8, 0, link) == 0.0
    assert allreduce_s(Topology.described("1x1", "1GB/s", "1gbit"), 10 * MB) == 0.0
    assert allreduce_phases(Topology.described("2x2", "1GB/s", "1gbit"), 0, "hierarchical") == ()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="positive"):
        ring_allreduce_s(0, 1.0, Link(0, 1))
    with pytest.raises(ValueError, match="nbytes"):
        ring_allreduce_s(2, -1.0, Link(0, 1))
    topo = Topology.described("2x2", "1GB/s", "1gbit")
    for call in (allreduce_s, nic_bytes, allreduce_phases):
        with pytest.raises(ValueError, match="known: ring, hierarchical"):
            call(topo, 1.0, "tree")


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_on_one_node_both_algorithms_are_the_intra_ring(ranks):
    topo = Topology.described(f"1x{ranks}", "300GB/s", "100gbit")
    for size in (4096, 64 * MB):
        ring = ring_allreduce_s(ranks, size, topo.intra)
        assert allreduce_s(topo, size, "ring") == allreduce_s(topo, size, "hierarchical") == ring
        assert nic_bytes(topo, size, "ring") == nic_bytes(topo, size, "hierarchical") == 0.0


def test_one_rank_per_node_is_a_ring_over_the_nics_with_rails_adding_bandwidth():
    topo = Topology.described("4x1", "300GB/s", "100gbit", rails=2)
    doubled = Link(topo.inter.alpha_s, 2 * topo.inter.bandwidth)
    for name in ALGORITHMS:
        assert allreduce_s(topo, 64 * MB, name) == pytest.approx(ring_allreduce_s(4, 64 * MB, doubled))


def test_two_nodes_of_two_ranks_flat_ring_pushes_one_and_a_half_gradients_through_each_nic():
    topo = Topology.described("2x2", "100GB/s", "10gbit")
    size = 100 * MB
    assert nic_bytes(topo, size, "ring") == pytest.approx(1.5 * size)
    assert nic_bytes(topo, size, "hierarchical") == pytest.approx(1.0 * size)
    # and 16x8: 2·127/128 vs 2·15/16
    big = Topology.described("16x8", "900GB/s", "100gbit")
    assert nic_bytes(big, size, "ring") == pytest.approx(2 * 127 / 128 * size)
    assert nic_bytes(big, size, "hierarchical") == pytest.approx(2 * 15 / 16 * size)


def test_flat_ring_closed_form_on_two_levels_is_paced_by_the_slowest_edge_of_each_step():
    topo = Topology.described("2x2", "100GB/s", "10gbit", rails=1)
    size, n = 40 * MB, 4
    step = max(topo.intra.alpha_s + size / n / topo.intra.bandwidth,
               topo.inter.alpha_s + size / n / topo.inter.bandwidth)
    assert allreduce_s(topo, size, "ring") == pytest.approx(2 * (n - 1) * step)
    hier = (2 * 1 * topo.intra.alpha_s + size / topo.intra.bandwidth
            + 2 * 1 * topo.inter.alpha_s + size / topo.inter.bandwidth)
    assert allreduce_s(topo, size, "hierarchical") == pytest.approx(hier)
    phases = allreduce_phases(topo, size, "hierarchical")
    assert [p.links for p in phases] == [("intra",), ("inter",), ("intra",)]
    assert sum(p.seconds for p in phases) == pytest.approx(hier)


def test_rails_divide_the_inter_time_of_both_algorithms():
    one = Topology.described("4x8", "900GB/s", "100gbit", inter_alpha_s=0.0, intra_alpha_s=0.0)
    four = Topology.described("4x8", "900GB/s", "100gbit", rails=4, inter_alpha_s=0.0, intra_alpha_s=0.0)
    size = 1e9
    assert allreduce_s(four, size, "ring") == pytest.approx(allreduce_s(one, size, "ring") / 4)
    inter_one = allreduce_phases(one, size, "hierarchical")[1].seconds
    inter_four = allreduce_phases(four, size, "hierarchical")[1].seconds
    assert inter_four == pytest.approx(inter_one / 4)


def test_hierarchical_beats_the_flat_ring_with_fast_intra_and_slow_inter_for_large_buffers():
    topo = Topology.described("2x2", "100GB/s", "1gbit")
    size = 256 * MB
    ring, hier = allreduce_s(topo, size, "ring"), allreduce_s(topo, size, "hierarchical")
    assert hier < ring
    assert ring / hier == pytest.approx(1.5, rel=0.01)  # the NIC carries 1.5 S vs 1.0 S
    assert best_algorithm(topo, size) == ("hierarchical", hier)


def test_flat_ring_wins_when_intra_is_no_faster_than_the_nics():
    # Why not "the flat ring wins for tiny S": in this model the flat ring pays the slow
    # link's α on all 2(N−1) steps and the hierarchical one on 2(M−1), so the hierarchical
    # algorithm is never slower on latency. The flat ring wins where its single phase
    # overlaps both link classes, i.e. when intra is not much faster than inter.
    topo = Topology.described("2x2", "125MB/s", "1gbit", intra_alpha_s=1e-5, inter_alpha_s=1e-5)
    size = 64 * MB
    ring, hier = allreduce_s(topo, size, "ring"), allreduce_s(topo, size, "hierarchical")
    assert ring < hier
    assert best_algorithm(topo, size) == ("ring", ring)
    tiny = Topology.described("2x2", "100GB/s", "1gbit")
    assert allreduce_s(tiny, 8, "hierarchical") < allreduce_s(tiny, 8, "ring")
    # latency-bound: 2(N−1) = 6 inter-latency steps vs 2 intra + 2 inter
    assert allreduce_s(tiny, 8, "ring") == pytest.approx(6 * tiny.inter.alpha_s, rel=1e-2)


@pytest.mark.parametrize("cluster, rails", [("1x8", 1), ("2x2", 1), ("16x8", 4), ("8x1", 2)])
def test_costs_are_monotonic_in_bytes(cluster, rails):
    topo = Topology.described(cluster, "300GB/s", "100gbit", rails=rails)
    sizes = [0, 1, 4096, 65536, 1 * MB, 16 * MB, 64 * MB, 1e9, 1.4e11]
    for name in ALGORITHMS:
        times = [allreduce_s(topo, s, name) for s in sizes]
        assert times == sorted(times), (name, times)
        assert all(t > 0 for t in times[1:])
        nics = [nic_bytes(topo, s, name) for s in sizes]
        assert nics == sorted(nics)


def test_seventy_billion_bf16_gradients_on_16x8_at_100gbit_take_seconds_not_milliseconds():
    topo = Topology.described("16x8", "900GB/s", "100gbit")
    grads = 70e9 * 2
    assert allreduce_s(topo, grads, "ring") > 2 * 127 / 128 * grads / 12.5e9  # ≥ 22 s
    assert best_algorithm(topo, grads)[1] > 10.0


def test_the_engines_measured_extra_cost_lands_on_the_first_phase_of_its_algorithm_only():
    from commsched.costmodel.topology import Link, Topology

    base = Topology(nodes=2, ranks_per_node=2, intra=Link(1e-4, 1e9), inter=Link(1e-4, 1e8))
    slow = Topology(nodes=2, ranks_per_node=2, intra=base.intra, inter=base.inter,
                    extra_s={"hierarchical": 2e-3}, extra_s_per_byte={"hierarchical": 1e-9})
    nbytes = 8 << 20
    assert allreduce_s(slow, nbytes, "ring") == allreduce_s(base, nbytes, "ring")
    extra = allreduce_s(slow, nbytes, "hierarchical") - allreduce_s(base, nbytes, "hierarchical")
    assert extra == pytest.approx(2e-3 + 1e-9 * nbytes)
    first, *rest = allreduce_phases(slow, nbytes, "hierarchical")
    assert first.seconds - allreduce_phases(base, nbytes, "hierarchical")[0].seconds == pytest.approx(extra)
    assert allreduce_s(slow, 0, "hierarchical") == 0.0  # nothing moves: no engine cost either
    again = Topology.from_dict(slow.to_dict())
    assert again.extra_s == slow.extra_s and again.extra_s_per_byte == slow.extra_s_per_byte
    with pytest.raises(ValueError, match="extra_s"):
        Topology(nodes=1, ranks_per_node=2, intra=base.intra, inter=base.inter, extra_s={"ring": -1.0})
