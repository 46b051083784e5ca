"""An emulated cluster on one machine: network namespaces, a bridge, ``tc tbf``.

Topology (a star: one switch, one link per node)::

    node ns  <prefix>n0   eth0 10.99.0.1 ──veth── p0 ┐
    node ns  <prefix>n1   eth0 10.99.0.2 ──veth── p1 ┤ br0 in switch ns <prefix>sw
    ...                                              ┘

Every link is shaped twice with a token bucket: the uplink on ``eth0`` inside
the node namespace and the downlink on ``p<i>`` inside the switch namespace.
Workers of one node share the node's namespace and talk over its own loopback,
which is unshaped unless ``intra_bandwidth`` is given; then one ``tbf`` on that
namespace's ``lo`` carries *all* intra-node traffic (both directions, every
pair): a shared bus such as a PCIe switch, not one link per pair.

Guarantees:

- Names carry a run prefix ``cs<pid>_<k>`` so concurrent runs never collide,
  and a later run can tell a dead run's leftovers (:func:`sweep_stale`).
- Addresses are private (``10.99.0.0/24``) and live only inside namespaces this
  module created; the host's own interfaces are never touched. Inside a node,
  the machine's hostname resolves to the node's address (``/etc/netns/<ns>/hosts``,
  which ``ip netns exec`` mounts over ``/etc/hosts``).
- :meth:`NetnsCluster.close` kills any process still inside the run's
  namespaces (by pid) and deletes them; deleting a namespace removes its veth
  ends and qdiscs with it. It is idempotent, and it runs on errors, SIGINT
  and SIGTERM when the cluster is used as a context manager under
  :func:`commsched.bench.procs.signals_raise`; the ``/etc/netns/<ns>`` files go too. Only SIGKILL leaves namespaces
  behind; the next run's :func:`sweep_stale` removes them.

:class:`LoopbackCluster` offers the same interface without namespaces
(unshaped 127.0.0.1), for machines without root.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: core needs nothing beyond the stdlib
    from typing_extensions import Self

logger = logging.getLogger(__name__)

SUBNET = "10.99.0."
NETMASK_BITS = 24
MTU = 9000
#: Token bucket depth. 256 KiB worked at 1-3 Gbit/s on this harness; it must
#: exceed the largest packet, 64 KiB on a loopback device.
BURST_BYTES = 256 * 1024
TBF_LATENCY = "20ms"
PREFIX_RE = re.compile(r"^cs(\d+)_\d+")
#: ``ip netns exec <ns>`` bind-mounts files from ``/etc/netns/<ns>/`` over /etc.
ETC_NETNS = "/etc/netns"
_COMMAND_TIMEOUT_S = 30.0
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_run_counter = count()


class NetworkSetupError(RuntimeError):
    """Creating the emulated network failed; nothing of it is left behind."""


def parse_rate(text: str | None) -> float | None:
    """Bits per second for a ``tc`` rate such as ``"1gbit"``; ``None`` for ``"none"``.

    Raises ``ValueError`` naming the accepted form when ``text`` is not a rate.
    """
    if text is None or text.strip().lower() in ("", "none", "0"):
        return None
    match = _RATE_RE.match(text.strip().lower())
    if not match:
        raise ValueError(
            f"bandwidth {text!r} is not a rate: use a number and a unit of "
            "bit/kbit/mbit/gbit/tbit (e.g. 1gbit, 500mbit) or 'none'"
        )
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if bits <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive, or 'none'")
    return bits


@dataclass(frozen=True)
class Node:
    """One emulated machine: where its workers run and the address they bind."""

    index: int
    address: str
    ifname: str
    namespace: str | None  # None: the host's own namespace (loopback mode)

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs inside this node.

        ``ip netns exec`` execs the command in place (no extra fork), so the
        pid of the started process is the worker's own pid.
        """
        if self.namespace is None:
            return list(argv)
        return ["ip", "netns", "exec", self.namespace, *argv]


def netns_available() -> tuple[bool, str]:
    """Whether this process can build a namespace cluster, and if not, why."""
    if os.geteuid() != 0:
        return False, "not root: network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) not found"
    return True, ""


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise NetworkSetupError(
            f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}"
        )
    return proc


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"]).stdout
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """Pids of processes living in ``namespace`` (empty when it is gone)."""
    proc = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_and_delete(namespaces: Sequence[str]) -> list[str]:
    """Kill processes inside ``namespaces``, delete them; names that failed."""
    existing = set(list_namespaces())
    mine = [ns for ns in namespaces if ns in existing]
    for ns in mine:
        for pid in namespace_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    failed = []
    for ns in mine:
        if _run(["ip", "netns", "del", ns], check=False).returncode != 0:
            failed.append(ns)
    for ns in namespaces:
        if ns not in failed:
            shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    with contextlib.suppress(OSError):  # only when empty: other runs may use it
        os.rmdir(ETC_NETNS)
    return failed


def sweep_stale() -> list[str]:
    """Delete namespaces left by runs whose process is gone (e.g. SIGKILLed).

    Only names of this module's form ``cs<pid>_<k>...`` whose ``<pid>`` is not
    a live process are touched. Returns the names deleted.
    """
    stale = []
    try:
        etc = os.listdir(ETC_NETNS)
    except OSError:
        etc = []
    for ns in sorted(set(list_namespaces()) | set(etc)):
        match = PREFIX_RE.match(ns)
        if match and not _pid_alive(int(match.group(1))):
            stale.append(ns)
    if stale:
        logger.warning("removing namespaces left by dead runs: %s", ", ".join(stale))
        _kill_and_delete(stale)
    return stale


class LoopbackCluster:
    """Unshaped stand-in: every node is the host's 127.0.0.1, no namespaces."""

    emulation = "loopback"

    def __init__(self, nodes: int, note: str = "") -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.nodes = [Node(i, "127.0.0.1", "lo", None) for i in range(nodes)]
        self.note = note or "unshaped loopback: no bandwidth emulation"

    @property
    def namespaces(self) -> list[str]:
        """Namespaces owned by this cluster (none)."""
        return []

    def close(self) -> None:
        """Nothing to tear down."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetnsCluster:
    """``nodes`` namespaces joined by a bridge, links shaped to ``bandwidth``.

    Built on ``__enter__`` (or :meth:`start`), torn down on ``__exit__`` /
    :meth:`close`. A failure half-way through :meth:`start` tears down what was
    built before raising :class:`NetworkSetupError`.
    """

    emulation = "netns"

    def __init__(
        self,
        nodes: int,
        bandwidth: str | None,
        intra_bandwidth: str | None = None,
        *,
        mtu: int = MTU,
        prefix: str | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if nodes > 250:
            raise ValueError(f"at most 250 nodes fit in {SUBNET}0/24, got {nodes}")
        self.bandwidth_bits = parse_rate(bandwidth)
        self.intra_bandwidth_bits = parse_rate(intra_bandwidth)
        self.mtu = mtu
        self.prefix = prefix or f"cs{os.getpid()}_{next(_run_counter)}"
        if not PREFIX_RE.match(self.prefix):
            raise ValueError(f"prefix {self.prefix!r} must look like cs<pid>_<k>")
        self.switch = f"{self.prefix}sw"
        self.nodes = [
            Node(i, f"{SUBNET}{i + 1}", "eth0", f"{self.prefix}n{i}")
            for i in range(nodes)
        ]
        self._created: list[str] = []
        shaped = "unshaped" if self.bandwidth_bits is None else bandwidth
        intra = "unshaped" if self.intra_bandwidth_bits is None else intra_bandwidth
        self.note = (
            f"netns star of {nodes} node(s), tc tbf {shaped} per link direction, "
            f"intra-node loopback {intra}"
        )

    @property
    def namespaces(self) -> list[str]:
        """Every namespace name this cluster owns, created or not yet."""
        return [self.switch] + [n.namespace for n in self.nodes if n.namespace]

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _tbf(self, ns: str, dev: str, bits: float) -> None:
        burst = max(BURST_BYTES, int(bits / 8 / 1000))  # >= 1 ms of traffic
        _run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
             "tbf", "rate", f"{int(bits)}bit", "burst", str(burst),
             "latency", TBF_LATENCY]
        )

    def _write_hosts(self, ns: str, address: str) -> None:
        """Make the machine's hostname resolve to the node's own address inside it.

        Code that finds its address from the hostname (Horovod 0.28's process-set
        gloo contexts ignore ``HOROVOD_GLOO_IFACE``) would otherwise get the
        host's 127.0.0.1, unreachable from the other nodes.
        """
        folder = os.path.join(ETC_NETNS, ns)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")

    def start(self) -> Self:
        """Create switch, bridge, node namespaces, veth pairs, addresses, qdiscs."""
        ok, why = netns_available()
        if not ok:
            raise NetworkSetupError(why)
        sweep_stale()
        try:
            self._add_ns(self.switch)
            sw = self.switch
            _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", "br0", "mtu", str(self.mtu), "up"])
            for node in self.nodes:
                ns, port = node.namespace, f"p{node.index}"
                assert ns is not None
                self._add_ns(ns)
                # Both ends are created directly inside their namespaces: no
                # name ever appears in the host's namespace.
                _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                      "peer", "name", port, "netns", sw])
                _run(["ip", "-n", sw, "link", "set", port, "mtu", str(self.mtu),
                      "master", "br0", "up"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu), "up"])
                _run(["ip", "-n", ns, "addr", "add",
                      f"{node.address}/{NETMASK_BITS}", "dev", "eth0"])
                if self.bandwidth_bits is not None:
                    self._tbf(ns, "eth0", self.bandwidth_bits)  # uplink
                    self._tbf(sw, port, self.bandwidth_bits)  # downlink
                if self.intra_bandwidth_bits is not None:
                    self._tbf(ns, "lo", self.intra_bandwidth_bits)
                self._write_hosts(ns, node.address)
        except BaseException:
            self.close()
            raise
        logger.info("emulated cluster up: %s", self.note)
        return self

    def close(self) -> None:
        """Kill what runs inside the run's namespaces and delete them. Idempotent."""
        if not self._created:
            return
        failed = _kill_and_delete(self._created)
        if failed:
            # A process that just died may still hold the namespace for a moment.
            time.sleep(0.2)
            failed = _kill_and_delete(failed)
        self._created = failed
        if failed:
            logger.error("could not delete namespaces: %s", ", ".join(failed))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


Cluster = NetnsCluster | LoopbackCluster


def make_cluster(
    network: str,
    nodes: int,
    bandwidth: str | None,
    intra_bandwidth: str | None = None,
) -> Cluster:
    """The cluster for ``--network``: netns when asked and possible, else loopback.

    The returned loopback cluster's ``note`` says why it fell back. Rates are
    validated in both modes so a typo fails before anything runs.
    """
    parse_rate(bandwidth)
    parse_rate(intra_bandwidth)
    if network == "loopback":
        return LoopbackCluster(nodes, "unshaped loopback (--network loopback)")
    if network != "netns":
        raise ValueError(f"network must be 'netns' or 'loopback', got {network!r}")
    ok, why = netns_available()
    if not ok:
        return LoopbackCluster(nodes, f"unshaped loopback: {why}")
    return NetnsCluster(nodes, bandwidth, intra_bandwidth)
