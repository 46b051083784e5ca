"""The project's one free-port helper and one Horovod-gloo environment helper."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from commsched.bench.procs import free_ports, horovod_gloo_env
from commsched.plugins.horovod_gloo import horovod_gloo_rendezvous


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(5)
    assert len(ports) == len(set(ports)) == 5
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            socks.append(s)
    finally:
        for s in socks:
            s.close()


def test_free_ports_rejects_a_count_below_one():
    with pytest.raises(ValueError, match="n >= 1"):
        free_ports(0)


def test_horovod_gloo_env_is_what_horovodrun_gloo_sets():
    slot = SimpleNamespace(hostname="node1", rank=3, size=4, local_rank=1, local_size=2,
                           cross_rank=1, cross_size=2)
    env = horovod_gloo_env("10.0.0.1", 4242, "veth1", slot)
    assert env == {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4242",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "veth1",
        "HOROVOD_HOSTNAME": "node1",
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
    }


def test_rendezvous_rejects_ranks_that_do_not_split_over_nodes(tmp_path):
    with pytest.raises(ValueError, match="multiple of nodes"):
        horovod_gloo_rendezvous(rank=0, world_size=3, nodes=2, run_dir=tmp_path,
                                master_addr="127.0.0.1", ifname="lo")


def test_rendezvous_gives_every_rank_its_slot_through_rank_0s_port(tmp_path):
    pytest.importorskip("horovod.runner.http.http_server")
    env0 = horovod_gloo_rendezvous(rank=0, world_size=4, nodes=2, run_dir=tmp_path,
                                   master_addr="127.0.0.1", ifname="lo")
    env3 = horovod_gloo_rendezvous(rank=3, world_size=4, nodes=2, run_dir=tmp_path,
                                   master_addr="127.0.0.1", ifname="lo", timeout_s=1)
    assert env0["HOROVOD_GLOO_RENDEZVOUS_PORT"] == env3["HOROVOD_GLOO_RENDEZVOUS_PORT"]
    assert (env3["HOROVOD_RANK"], env3["HOROVOD_HOSTNAME"], env3["HOROVOD_LOCAL_RANK"]) == ("3", "node1", "1")


def test_rendezvous_times_out_naming_the_port_file_when_rank_0_never_publishes(tmp_path):
    pytest.importorskip("horovod.runner.http.http_server")
    with pytest.raises(TimeoutError, match="horovod_rendezvous_port"):
        horovod_gloo_rendezvous(rank=1, world_size=2, nodes=2, run_dir=tmp_path,
                                master_addr="127.0.0.1", ifname="lo", timeout_s=0.2)
