"""The dependency bound (commsched.costmodel.bounds): its closed form, its checks, and that no
simulated schedule of whole gradients beats it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.costmodel.bounds import bound_by_bytes, dependency_bound
from commsched.costmodel.collectives import allreduce_s
from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec
from commsched.costmodel.simulator import SimSettings, simulate
from commsched.costmodel.topology import Link, Topology

MB = 1 << 20


def test_equal_layers_pay_the_first_layers_all_reduce_after_the_whole_compute():
    # 8 layers of 10 ms forward, backward 40 ms each in reverse (layer 0 ready last, at 320 ms).
    # With 75 ms of link each, the link needs 600 ms, and none of it can start before the last
    # layer's gradient (80 ms of forward + 40 of backward) nor end after the next forward reaches
    # that layer (70 ms in): 0.12 + 0.6 - 0.07, more than the link alone.
    n = 8
    ready = [0.04 * (n - k) for k in range(n)]
    b = dependency_bound([0.01] * n, ready, [0.075] * n, backward_s=0.32)
    assert (b.compute_s, b.comm_s) == (pytest.approx(0.4), pytest.approx(0.6))
    assert b.step_s == pytest.approx(0.65) and b.layer == 7
    # with 40 ms each, layer 0 binds: it is reduced after backward ends, the next forward waits
    lighter = dependency_bound([0.01] * n, ready, [0.04] * n, backward_s=0.32)
    assert lighter.step_s == pytest.approx(0.4 + 0.04) and lighter.layer == 0


def test_a_large_second_layer_binds_with_everything_before_it_on_the_link():
    # layer 1 holds most bytes and is ready 50 ms before backward ends; the next forward reaches it
    # after layer 0's 100 ms: 0.2 (forward) + 0.45 + (0 + 1.0) - 0.1 = 1.55 > comm 1.0 > compute 0.7
    b = dependency_bound([0.1, 0.1], [0.5, 0.45], [0.0, 1.0], backward_s=0.5)
    assert b.step_s == pytest.approx(1.55) and b.layer == 1


def test_a_layers_own_update_overlaps_its_all_reduce_the_later_ones_do_not():
    # layer 0's update (20 ms) may run piece by piece as its all-reduce lands; layer 1's comes
    # after layer 0's forward: 0.5 + 0.2 + (0.1 + 0.1) + 0.02
    b = dependency_bound([0.1, 0.1], [0.5, 0.3], [0.2, 0.2], backward_s=0.5, apply_s=[0.02, 0.02])
    assert b.compute_s == pytest.approx(0.74)
    assert b.step_s == pytest.approx(0.5 + 0.2 + 0.2 + 0.02) and b.layer == 0


def test_a_layer_without_gradients_only_adds_its_forward():
    b = dependency_bound([0.05, 0.1], [None, 0.4], [0.0, 0.3], backward_s=0.4)
    # layer 1: 0.15 + 0.4 + 0.3 - 0.05
    assert b.step_s == pytest.approx(0.8) and b.layer == 1


def test_bound_by_bytes_splits_the_link_and_the_update_by_bytes():
    alone = bound_by_bytes([0.1, 0.1], [0.4, 0.2], [500, 500], backward_s=0.4, comm_s=0.5, optimizer_s=0.05)
    # the update split by bytes: 25 ms a layer, layer 0's own left out
    assert alone.step_s == pytest.approx(0.4 + 0.25 + 0.2 + 0.025) and alone.layer == 0
    assert bound_by_bytes([0.1], [None], [0], backward_s=0.1, comm_s=0.5) is None


@pytest.mark.parametrize("call,match", [
    (lambda: dependency_bound([0.1, 0.1], [0.2], [0.1, 0.1], backward_s=0.2), "ready_s has 1 entries for 2"),
    (lambda: dependency_bound([0.1], [-0.2], [0.1], backward_s=0.2), r"ready_s\[0\]"),
    (lambda: dependency_bound([float("nan")], [0.2], [0.1], backward_s=0.2), r"forward_s\[0\]"),
    (lambda: dependency_bound([0.1], [0.2], [0.1], backward_s=-1), "backward_s"),
])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _profile(sizes_mb, fwd, bwd, apply):
    layers = tuple(LayerProfile(name=f"l{i}", forward_s=f, backward_s=b, apply_s=apply,
                                tensors=(TensorSpec(f"l{i}.w", max(1, int(mb * MB) // 4), 4),))
                   for i, (mb, f, b) in enumerate(zip(sizes_mb, fwd, bwd, strict=True)))
    return Profile(layers=layers, per_piece_cpu_s=0.0)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 6), bandwidth=st.floats(2e7, 2e9),
       name=st.sampled_from(["ddp", "ddp:1", "fifo", "dynamic", "static", "allreduce"]))
def test_no_simulated_schedule_beats_the_bound(data, n, bandwidth, name):
    sizes = data.draw(st.lists(st.floats(0.05, 20.0), min_size=n, max_size=n))
    fwd = data.draw(st.lists(st.floats(0.0, 0.05), min_size=n, max_size=n))
    bwd = data.draw(st.lists(st.floats(0.001, 0.1), min_size=n, max_size=n))
    prof = _profile(sizes, fwd, bwd, 0.001)
    link = Link(alpha_s=0.0, bandwidth=bandwidth)  # no latency: a ring's time is linear in bytes
    topo = Topology(nodes=2, ranks_per_node=1, intra=link, inter=link)
    comm = allreduce_s(topo, prof.grad_bytes, "ring")
    bound = bound_by_bytes([layer.forward_s for layer in prof.layers], prof.ready_times(),
                           [layer.grad_bytes for layer in prof.layers], backward_s=prof.backward_s, comm_s=comm,
                           apply_s=[layer.apply_s for layer in prof.layers])
    result = simulate(prof, topo, name, SimSettings(partition_bytes=MB // 4, credit_bytes=MB))
    assert result.step_time_s >= bound.step_s * (1 - 1e-9)
