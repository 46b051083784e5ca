"""Topology: bandwidth parsing, validation, the described and emulated clusters, JSON."""

import json
import subprocess
import sys
import textwrap

import pytest

from commsched.costmodel.topology import (
    EMULATED_ALPHA_S,
    INTER_ALPHA_S,
    LINK_OVERHEAD,
    LOOPBACK_BANDWIDTH,
    SCHEMA,
    Link,
    Topology,
    parse_bandwidth,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("text, expected", [
    ("1gbit", 1e9 / 8), ("500mbit", 500e6 / 8), ("100gbit", 100e9 / 8), ("2.5gbit", 2.5e9 / 8),
    ("800kbit", 800e3 / 8), ("10Gbps", 10e9 / 8), ("25Gbit/s", 25e9 / 8),
    ("900GB/s", 900e9), ("25GB/s", 25e9), ("250MB/s", 250e6), ("1GiB/s", 2.0**30), ("50GBps", 50e9),
    ("12345", 12345.0), ("1.5e9", 1.5e9), (3e9, 3e9), (" 1 gbit ", 1e9 / 8),
])
def test_parse_bandwidth_reads_bits_and_bytes_by_the_unit(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text", ["fast", "1gbits/hour", "GB/s", "-1gbit", "0", "0gbit", "1xB/s", "", True])
def test_parse_bandwidth_refuses_what_is_not_a_positive_rate_and_names_the_forms(text):
    with pytest.raises(ValueError) as info:
        parse_bandwidth(text)
    assert repr(text) in str(info.value)
    assert "gbit" in str(info.value) and "GB/s" in str(info.value)


@pytest.mark.parametrize("alpha, bandwidth", [(-1e-6, 1e9), (0.0, 0.0), (0.0, -5.0), (float("nan"), 1e9),
                                              (0.0, float("inf"))])
def test_link_refuses_negative_latency_and_non_positive_bandwidth(alpha, bandwidth):
    with pytest.raises(ValueError):
        Link(alpha, bandwidth)


@pytest.mark.parametrize("field, value", [("nodes", 0), ("ranks_per_node", -2), ("rails", 0), ("nodes", 1.5),
                                          ("nodes", True)])
def test_topology_refuses_non_positive_counts_naming_the_field(field, value):
    kwargs = dict(nodes=2, ranks_per_node=2, intra=Link(0, 1e9), inter=Link(0, 1e8))
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        Topology(**kwargs)


def test_described_cluster_parses_nodes_ranks_bandwidths_and_uses_the_nccl_latencies():
    t = Topology.described("16x8", intra="900GB/s", inter="100gbit", rails=4)
    assert (t.nodes, t.ranks_per_node, t.rails, t.world_size) == (16, 8, 4, 128)
    assert t.intra.bandwidth == 900e9 and t.inter.bandwidth == 12.5e9
    assert t.inter.alpha_s == INTER_ALPHA_S and 0 < t.intra.alpha_s < t.inter.alpha_s
    assert t.source == "described" and t.meta["cluster"] == "16x8"
    assert Topology.described("2x2", 1e10, 1e9, intra_alpha_s=0.0).intra == Link(0.0, 1e10)


@pytest.mark.parametrize("cluster", ["16", "16x", "x8", "0x8", "16x0", "a by b"])
def test_described_cluster_refuses_a_malformed_shape(cluster):
    with pytest.raises(ValueError, match="NODESxRANKS|positive integer"):
        Topology.described(cluster, "900GB/s", "100gbit")


def test_emulated_without_nodes_makes_every_worker_a_node_behind_a_shaped_link():
    t = Topology.emulated(4, None, "1gbit")
    assert (t.nodes, t.ranks_per_node, t.source) == (4, 1, "emulated")
    # tbf counts frames: the payload rate is the shaped rate less the header overhead (~0.74 % at MTU 9000)
    assert t.inter.bandwidth == pytest.approx(1e9 / 8 / LINK_OVERHEAD)
    assert 0.006 < LINK_OVERHEAD - 1 < 0.008
    assert t.inter.alpha_s == EMULATED_ALPHA_S


def test_emulated_nodes_share_an_unshaped_loopback_or_a_shaped_bus_among_their_ranks():
    t = Topology.emulated(4, 2, "2gbit")
    assert (t.nodes, t.ranks_per_node) == (2, 2)
    assert t.intra.bandwidth == LOOPBACK_BANDWIDTH
    shaped = Topology.emulated(8, 2, "1gbit", intra_bandwidth="4gbit", alpha_s=1e-4)
    # one tbf on lo carries the 4 concurrent ring flows of the node: each gets a quarter
    assert shaped.intra.bandwidth == pytest.approx(4e9 / 8 / 4, rel=2e-3)
    assert shaped.intra.alpha_s == shaped.inter.alpha_s == 1e-4
    assert Topology.emulated(4, 2, "1gbit", intra_bandwidth="none").intra.bandwidth == LOOPBACK_BANDWIDTH


def test_emulated_refuses_workers_that_do_not_divide_into_nodes():
    with pytest.raises(ValueError, match="multiple"):
        Topology.emulated(5, 2, "1gbit")


def test_topology_round_trips_through_json(tmp_path):
    t = Topology.described("4x8", "300GB/s", "200gbit", rails=2)
    path = tmp_path / "topo.json"
    t.to_json(str(path))
    assert json.loads(path.read_text())["schema"] == SCHEMA
    assert Topology.from_json(str(path)) == t
    e = Topology.emulated(4, 2, "1gbit", "3gbit")
    assert Topology.from_dict(json.loads(json.dumps(e.to_dict()))) == e


def test_from_dict_refuses_another_schema_saying_how_to_make_a_topology(tmp_path):
    data = Topology.described("2x2", "1GB/s", "1gbit").to_dict()
    data["schema"] = "commsched-profile/1"
    with pytest.raises(ValueError, match="commsched probe.*--cluster"):
        Topology.from_dict(data)
    del data["schema"]
    with pytest.raises(ValueError, match="schema None"):
        Topology.from_dict(data)
    bad = Topology.described("2x2", "1GB/s", "1gbit").to_dict()
    del bad["inter"]
    with pytest.raises(ValueError, match="missing or mistypes"):
        Topology.from_dict(bad)
    path = tmp_path / "cut.json"
    path.write_text('{"schema": "commsched-topology/1", "nod')
    with pytest.raises(ValueError, match="not valid JSON"):
        Topology.from_json(str(path))


def test_cost_model_modules_import_with_every_framework_blocked():
    code = textwrap.dedent("""
        import sys
        for name in ["torch", "tensorflow", "mxnet", "horovod", "keras", "jax", "numpy"]:
            sys.modules[name] = None
        import commsched.costmodel.topology, commsched.costmodel.collectives, commsched.costmodel.zoo
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr
