"""The framework-free bench harness: emulated network, worker groups, CPU sampling.

Namespace tests need root (they skip without it; CI runs as root). They assert
structure and cleanup, never speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from commsched.bench import netns
from commsched.bench.cpu import busy_fraction, read_cpu_times
from commsched.bench.netns import (
    LoopbackCluster,
    NetnsCluster,
    NetworkSetupError,
    list_namespaces,
    make_cluster,
    parse_rate,
    sweep_stale,
)
from commsched.bench.procs import WorkerError, WorkerGroup

needs_root = pytest.mark.skipif(
    not netns.netns_available()[0], reason=f"needs root and iproute2: {netns.netns_available()[1]}"
)


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def _left_over(prefix: str) -> list[str]:
    """The run's namespaces, and its /etc/netns files, that still exist."""
    etc = os.listdir(netns.ETC_NETNS) if os.path.isdir(netns.ETC_NETNS) else []
    return [ns for ns in list_namespaces() + etc if ns.startswith(prefix)]


# ---------------------------------------------------------------- rates


def test_parse_rate_accepts_tc_rates_and_none():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("500mbit") == 5e8
    assert parse_rate("2.5Gbit") == 2.5e9
    assert parse_rate("none") is None
    assert parse_rate(None) is None


@pytest.mark.parametrize("bad", ["1gb", "fast", "-1gbit", "1 gbit/s"])
def test_parse_rate_rejects_non_rates_with_the_accepted_form(bad):
    with pytest.raises(ValueError, match="gbit"):
        parse_rate(bad)


def test_loopback_cluster_runs_commands_unwrapped_on_127_0_0_1():
    with LoopbackCluster(2) as cluster:
        assert [n.address for n in cluster.nodes] == ["127.0.0.1", "127.0.0.1"]
        assert cluster.nodes[1].wrap(["python", "-V"]) == ["python", "-V"]
        assert cluster.emulation == "loopback"


def test_make_cluster_honours_loopback_and_validates_rates_first():
    assert make_cluster("loopback", 2, "1gbit").emulation == "loopback"
    with pytest.raises(ValueError):
        make_cluster("loopback", 2, "1 gigabit")
    with pytest.raises(ValueError, match="netns"):
        make_cluster("infiniband", 2, "1gbit")


# ---------------------------------------------------------------- netns


@needs_root
def test_netns_cluster_builds_shaped_star_and_removes_all_of_it():
    cluster = NetnsCluster(2, "1gbit", intra_bandwidth="2gbit")
    with cluster:
        assert set(cluster.namespaces) <= set(list_namespaces())
        n0, n1 = cluster.nodes
        assert (n0.address, n1.address) == ("10.99.0.1", "10.99.0.2")
        assert n0.wrap(["true"]) == ["ip", "netns", "exec", n0.namespace, "true"]
        up = _run("ip", "netns", "exec", n0.namespace, "tc", "qdisc", "show", "dev", "eth0")
        down = _run("ip", "netns", "exec", cluster.switch, "tc", "qdisc", "show", "dev", "p1")
        lo = _run("ip", "netns", "exec", n1.namespace, "tc", "qdisc", "show", "dev", "lo")
        assert "tbf" in up and "rate 1Gbit" in up
        assert "tbf" in down and "rate 1Gbit" in down
        assert "tbf" in lo and "rate 2Gbit" in lo
        # Inside a node the hostname is the node's own address, not 127.0.0.1.
        resolved = _run(*n1.wrap([sys.executable, "-c",
                                  "import socket; print(socket.gethostbyname(socket.gethostname()))"]))
        assert resolved.strip() == "10.99.0.2"
        # The nodes reach each other through the bridge.
        server = subprocess.Popen(
            n0.wrap([sys.executable, "-c", textwrap.dedent("""
                import socket
                s = socket.socket(); s.bind(("10.99.0.1", 5000)); s.listen()
                print("up", flush=True)
                c, _ = s.accept(); c.sendall(b"hello"); c.close()
            """)]),
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert server.stdout.readline().strip() == "up"
            got = _run(*n1.wrap([sys.executable, "-c",
                                 "import socket; c = socket.create_connection(('10.99.0.1', 5000),"
                                 " timeout=10); print(c.recv(5).decode())"]))
            assert got.strip() == "hello"
        finally:
            server.kill()
            server.wait()
    assert _left_over(cluster.prefix) == []


@needs_root
def test_close_kills_processes_left_inside_the_namespaces():
    cluster = NetnsCluster(1, "1gbit").start()
    try:
        sleeper = subprocess.Popen(cluster.nodes[0].wrap(["sh", "-c", "echo in; exec sleep 60"]),
                                   stdout=subprocess.PIPE, text=True)
        assert sleeper.stdout.readline() == "in\n"  # it is inside the namespace now
        assert netns.namespace_pids(cluster.nodes[0].namespace) == [sleeper.pid]
    finally:
        cluster.close()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    sleeper.stdout.close()
    assert _left_over(cluster.prefix) == []
    cluster.close()  # idempotent


@needs_root
def test_setup_failing_half_way_leaves_nothing(monkeypatch):
    real_run = netns._run
    veths = []

    def failing_run(argv, *, check=True):
        if argv[:3] == ["ip", "link", "add"]:
            veths.append(argv)
            if len(veths) == 2:  # the second node's link: one node is complete by then
                raise NetworkSetupError("injected failure")
        return real_run(argv, check=check)

    monkeypatch.setattr(netns, "_run", failing_run)
    cluster = NetnsCluster(3, "1gbit")
    with pytest.raises(NetworkSetupError, match="injected"):
        cluster.start()
    monkeypatch.setattr(netns, "_run", real_run)
    assert _left_over(cluster.prefix) == []


@needs_root
def test_sweep_stale_removes_dead_runs_only():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, alive = f"cs{dead.pid}_0sw", f"cs{os.getpid()}_999sw"
    _run("ip", "netns", "add", stale)
    _run("ip", "netns", "add", alive)
    try:
        removed = sweep_stale()
        names = list_namespaces()
        assert stale in removed and stale not in names
        assert alive in names
    finally:
        for ns in (stale, alive):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@needs_root
def test_failed_and_hung_workers_are_reported_killed_and_the_network_removed(tmp_path):
    with NetnsCluster(2, "1gbit") as cluster:
        group = WorkerGroup.start(
            [cluster.nodes[0].wrap(["sh", "-c", "echo boom; exit 3"]),
             cluster.nodes[1].wrap(["sleep", "60"])],
            [dict(os.environ)] * 2,
            [str(tmp_path / "r0.log"), str(tmp_path / "r1.log")],
        )
        with pytest.raises(WorkerError) as err:
            group.wait(timeout_s=30, tick_s=0.05, grace_s=0.5)
        hung_pid = group.pids[1]
    message = str(err.value)
    assert "rank 0" in message and "exited 3" in message and "boom" in message
    assert f"rank 1 (pid {hung_pid}) still running, killed" in message
    assert all(p.poll() is not None for p in group.procs)
    assert _left_over(cluster.prefix) == []


_HARNESS_SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from commsched.bench.netns import NetnsCluster
    from commsched.bench.procs import signals_raise
    with signals_raise(), NetnsCluster(2, "1gbit") as cluster:
        sleeper = subprocess.Popen(cluster.nodes[1].wrap(["sh", "-c", "echo; exec sleep 60"]),
                                   stdout=subprocess.PIPE)
        sleeper.stdout.readline()  # inside its namespace now
        print(cluster.prefix, sleeper.pid, flush=True)
        time.sleep(60)
""")


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_harness_tears_the_network_down(sig):
    proc = subprocess.Popen([sys.executable, "-c", _HARNESS_SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        prefix, sleeper = proc.stdout.readline().split()
        assert _left_over(prefix)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert _left_over(prefix) == []
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{sleeper}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{sleeper}")


# ---------------------------------------------------------------- processes


def test_worker_group_returns_when_all_exit_zero(tmp_path):
    group = WorkerGroup.start([["true"], ["true"]], [dict(os.environ)] * 2,
                              [str(tmp_path / "a"), str(tmp_path / "b")])
    group.wait(timeout_s=30, tick_s=0.01)
    assert [p.returncode for p in group.procs] == [0, 0]


def test_worker_group_kills_hung_workers_at_the_deadline(tmp_path):
    group = WorkerGroup.start([["true"], ["sleep", "60"]], [dict(os.environ)] * 2,
                              [str(tmp_path / "a"), str(tmp_path / "b")])
    with pytest.raises(WorkerError, match="timed out"):
        group.wait(timeout_s=0.5, tick_s=0.01)
    assert group.procs[1].returncode == -signal.SIGKILL


# ---------------------------------------------------------------- cpu


def test_busy_fraction_counts_idle_and_iowait_as_not_busy(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4\n")
    start = read_cpu_times(str(stat))
    stat.write_text("cpu  150 0 150 750 150 0 0 0 0 0\n")
    assert busy_fraction(start, read_cpu_times(str(stat))) == pytest.approx(0.5)
    assert busy_fraction(start, start) is None


def test_busy_fraction_of_this_machine_is_a_fraction():
    start = read_cpu_times()
    sum(i * i for i in range(200_000))
    value = busy_fraction(start, read_cpu_times())
    assert value is None or 0.0 <= value <= 1.0
