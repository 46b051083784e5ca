"""The topology probe: the α-β fit on synthetic points, and a short real probe of a shaped cluster."""

from __future__ import annotations

import os

import pytest

from commsched.bench import netns
from commsched.costmodel.fit import fit_link, ping_pong, ring_allreduce
from commsched.costmodel.topology import Link, Topology

SIZES = [4096 * 4 ** k for k in range(8)]

needs_root = pytest.mark.skipif(not netns.netns_available()[0],
                                reason=f"emulated cluster unavailable: {netns.netns_available()[1]}")


@pytest.mark.parametrize("n", [2, 4])
def test_the_fit_recovers_alpha_and_beta_of_exact_ring_and_ping_pong_times(n):
    alpha, beta = 1.5e-4, 1.2e8
    samples = [ring_allreduce(n, s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta) for s in SIZES]
    samples += [ping_pong(s, 2 * alpha + (s + 4) / beta) for s in SIZES]
    fit = fit_link(samples)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9) and fit.bandwidth == pytest.approx(beta, rel=1e-9)
    assert max(abs(r) for r in fit.residuals) < 1e-9 and not fit.alpha_clamped


def test_a_disturbed_point_is_dropped_and_the_rest_still_fit_exactly():
    alpha, beta = 2e-4, 6e7
    times = [2 * alpha + s / 2 / beta * 2 for s in SIZES]  # n=2: 2 steps, S bytes per link
    times[1] *= 8  # another process held the CPU during this one
    fit = fit_link([ring_allreduce(2, s, t) for s, t in zip(SIZES, times, strict=True)], max_residual=0.25)
    assert fit.dropped == (1,)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9) and fit.bandwidth == pytest.approx(beta, rel=1e-9)


def test_the_bandwidth_used_ignores_one_disturbed_large_size():
    from commsched.plugins.torch.probe import _robust_bandwidth
    alpha, beta = 4e-4, 1.24e8
    big = SIZES[-3:]  # 4, 16, 64 MiB: the sizes the probe reads beta from on a shaped link
    times = [2 * alpha + s / beta for s in big]
    times[-1] *= 2  # the 64 MiB run shared the cores with another job
    samples = [ring_allreduce(2, s, t) for s, t in zip(big, times, strict=True)]
    assert _robust_bandwidth(samples, alpha)["bandwidth"] == pytest.approx(beta, rel=1e-9)
    assert fit_link(samples).bandwidth < 0.9 * beta  # a least-squares beta moves by ~11 %
    assert _robust_bandwidth([ring_allreduce(2, 4096, 1e-4)], alpha)["bandwidth"] is None  # all latency


def test_a_negative_latency_is_clamped_to_zero_and_beta_refitted():
    beta = 1e8
    fit = fit_link([ping_pong(s, (s + 4) / beta - 2e-5) for s in SIZES[3:]])  # alpha = -10 us
    assert fit.alpha_clamped and fit.alpha_s == 0 and fit.bandwidth == pytest.approx(beta, rel=0.02)


def test_the_fit_refuses_points_that_cannot_determine_beta():
    with pytest.raises(ValueError, match="at least 2 samples"):
        fit_link([ping_pong(4096, 1e-3)])
    with pytest.raises(ValueError, match="> 0"):
        fit_link([ping_pong(4096, 1e-3), ping_pong(8192, 0.0)])


def test_bad_flags_are_refused_naming_the_flag(capsys):
    from commsched.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["probe", "--workers", "2", "--bandwidth", "nonsense", "--json", "t.json"])
    assert exc.value.code == 2 and "--bandwidth" in capsys.readouterr().err
    assert main(["probe", "--workers", "4", "--nodes", "3", "--json", "t.json"]) == 2
    assert "--nodes 3 must divide --workers 4" in capsys.readouterr().err


@needs_root
def test_a_short_probe_of_a_shaped_two_node_cluster_finds_the_configured_bandwidth(tmp_path):
    from commsched.plugins.torch.probe import probe
    topo = probe(2, 2, "500mbit", repeats=2, sizes=tuple(SIZES[2::2]) + (SIZES[-1],),
                 log_stream=open(os.devnull, "w"))
    configured = Topology.emulated(2, 2, "500mbit")
    assert topo.source == "probe" and (topo.nodes, topo.ranks_per_node) == (2, 1)
    assert topo.inter.bandwidth == pytest.approx(configured.inter.bandwidth, rel=0.15)
    assert topo.meta["points"]["inter_pingpong"] and topo.meta["fits"]["inter_allreduce"]["residuals"]
    assert netns.list_namespaces() == [ns for ns in netns.list_namespaces() if not ns.startswith(f"cs{os.getpid()}_")]
    path = tmp_path / "topo.json"
    topo.to_json(str(path))
    assert Topology.from_json(str(path)) == topo


def test_the_engines_cost_beyond_alpha_beta_is_fitted_per_algorithm_and_cached_per_cluster(tmp_path):
    from commsched.costmodel.collectives import allreduce_s
    from commsched.plugins.torch.probe import _engine_extra, cached_probe, save_probe

    fitted = Topology(nodes=2, ranks_per_node=2, intra=Link(1e-4, 1e9), inter=Link(2e-4, 6e7), source="probe",
                      meta={"workers": 4, "nodes": 2, "bandwidth": "500mbit", "intra_bandwidth": None})
    sizes = [4096 * 4 ** k for k in range(6)]
    points = {kind: [{"bytes": b, "time_s": allreduce_s(fitted, b, alg) + extra + per_byte * b, "n": 4}
                     for b in sizes]
              for kind, alg, extra, per_byte in (("world_allreduce", "ring", 0.0, 0.0),
                                                 ("world_hierarchical", "hierarchical", 3e-3, 2e-9))}
    extra = _engine_extra(points, fitted)
    assert extra["ring"] == pytest.approx(0.0, abs=1e-12) and extra["per_byte"]["ring"] == pytest.approx(0.0, abs=1e-15)
    assert extra["hierarchical"] == pytest.approx(3e-3 + 2e-9 * 65536, rel=0.05)  # the median of the small sizes
    assert extra["per_byte"]["hierarchical"] == pytest.approx(2e-9)
    assert cached_probe(4, 2, "500mbit", cache_dir=str(tmp_path)) is None
    save_probe(fitted, "netns", cache_dir=str(tmp_path))
    assert cached_probe(4, 2, "500mbit", cache_dir=str(tmp_path)) == fitted
    assert cached_probe(4, 2, "1gbit", cache_dir=str(tmp_path)) is None  # another cluster: no entry
    assert cached_probe(4, 2, "500mbit", network="loopback", cache_dir=str(tmp_path)) is None
