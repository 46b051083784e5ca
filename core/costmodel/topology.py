"""Where the ranks are and what connects them: nodes × ranks per node, two link classes.

A :class:`Topology` is ``nodes`` machines of ``ranks_per_node`` ranks each. Ranks of one
node talk over the ``intra`` link class (NVLink, PCIe, or the emulated node's
loopback); nodes talk over the ``inter`` class: each node has ``rails`` network
links (NICs) of ``inter.bandwidth`` each, one switch, rail-aligned rings (the NIC of
local rank ``i`` talks to the NIC of local rank ``i`` on the other nodes). Each link
class is an α-β :class:`Link`: a message of ``S`` bytes over one link takes
``alpha_s + S / bandwidth``, and ``bandwidth`` holds in each direction at once (full
duplex).

Three sources, recorded in ``source``:

* ``described`` — :meth:`Topology.described`, from ``--cluster 16x8 --intra 900GB/s
  --inter 100gbit [--rails K]``, with NCCL's latency constants unless given;
* ``emulated`` — :meth:`Topology.emulated`, the cluster ``commsched bench --workers N
  [--nodes M] --bandwidth B [--intra-bandwidth B2]`` builds on this machine;
* ``probe`` — fitted by ``commsched probe`` (written with :meth:`Topology.to_json`).

JSON carries :data:`SCHEMA`; a file of another schema, or with a bad field, is
refused with a ``ValueError`` that says how to make one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from commsched.bench.netns import MTU
from commsched.costmodel.profile import check_schema, load_json, write_json

__all__ = [
    "EMULATED_ALPHA_S",
    "INTER_ALPHA_S",
    "INTRA_ALPHA_S",
    "LINK_OVERHEAD",
    "LOOPBACK_BANDWIDTH",
    "SCHEMA",
    "Link",
    "Topology",
    "parse_bandwidth",
]

SCHEMA = "commsched-topology/1"

#: Latency of one ring step between GPUs of a node over NVLink: NCCL's own tuning
#: model (``src/graph/tuning.cc``, ``hwLat[NVLINK][Ring][Simple]`` = 3.4 µs).
INTRA_ALPHA_S = 3.4e-6
#: Latency of one ring step over the network (100-400 Gbit/s InfiniBand/RoCE): NCCL's
#: ``hwLat[NET][Ring][Simple]`` = 9.6 µs, inside the 5-10 µs usually measured per step.
INTER_ALPHA_S = 9.6e-6
#: Software cost of one ring step of a gloo collective on this machine. A tiny
#: all-reduce of 2 gloo processes (2 ring steps) costs 150-350 µs here (ENVIRONMENT.md),
#: so 125 µs per step; on a loaded machine it was measured at 760 µs (2 processes) and
#: 3.3 ms (4 processes on the 2 cores): ``commsched probe`` fits the real value.
EMULATED_ALPHA_S = 1.25e-4
#: Bytes/s of gloo between two processes over an unshaped loopback: 100 MB all-reduce of
#: 2 processes in 0.07-0.12 s (ENVIRONMENT.md; 0.113 s measured once on a loaded
#: machine), so 1 GB/s. CPU-bound (copies and the reduction), not a link rate.
LOOPBACK_BANDWIDTH = 1.0e9
#: Wire bytes per payload byte on the emulated links: a TCP segment of MTU - 52 payload
#: bytes (IPv4 20 + TCP with timestamps 32) is a frame of MTU + 14 (Ethernet) bytes, and
#: ``tc tbf`` counts frames. 0.74 % at MTU 9000 (4.6 % at 1500), as measured.
LINK_OVERHEAD = (MTU + 14) / (MTU - 52)
#: The loopback's 64 KiB MTU: the same overhead, negligible (0.1 %).
_LO_OVERHEAD = (65536 + 14) / (65536 - 52)

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*([A-Za-z/]*)\s*$")
_ACCEPTED = ("a number of bytes/s, or a number and a unit: tc-style bits 'kbit'/'mbit'/'gbit'/'tbit' "
             "(e.g. 1gbit, 500mbit, 2.5gbit), bits per second 'Mbps'/'Gbps' or 'Gbit/s', "
             "bytes per second 'MB/s'/'GB/s'/'GiB/s' or 'GBps' (e.g. 900GB/s, 25GB/s)")


def _unit_scale(unit: str) -> float | None:
    """Bytes/s per unit of ``unit``; ``None`` when it is not a rate unit."""
    lower = unit.lower()
    if unit == "":
        return 1.0
    if lower.endswith("bit/s") or lower.endswith("bit"):
        prefix, per_byte = lower[: lower.rindex("bit")], 1 / 8
    elif unit.endswith("bps"):  # lower-case b: bits (Gbps)
        prefix, per_byte = lower[:-3], 1 / 8
    elif unit.endswith("Bps") or unit.endswith("B/s"):  # upper-case B: bytes (GB/s, GBps)
        prefix, per_byte = lower[:-3], 1.0
    else:
        return None
    scale = _PREFIX.get(prefix)
    return None if scale is None else scale * per_byte


def parse_bandwidth(text: str | float) -> float:
    """Bytes per second for a bandwidth such as ``"100gbit"``, ``"10Gbps"`` or ``"900GB/s"``.

    Bits or bytes follow the unit: ``bit``/``bps`` (``"1gbit"``, ``"10Gbps"``,
    ``"25Gbit/s"``) are bits, ``B/s``/``Bps`` (``"900GB/s"``, ``"25GBps"``) bytes.
    Prefixes are decimal (``g`` = 1e9) except ``Ki``/``Mi``/``Gi``/``Ti``. A plain
    number (or a numeric string) is bytes/s. Guarantees a finite value > 0; anything
    else raises ``ValueError`` naming the text and the accepted forms.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _NUMBER_UNIT.match(text) if isinstance(text, str) else None
        scale = _unit_scale(match.group(2)) if match else None
        if scale is None:
            raise ValueError(f"bandwidth {text!r} is not understood: use {_ACCEPTED}")
        value = float(match.group(1)) * scale
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"bandwidth {text!r} must be a finite rate > 0: use {_ACCEPTED}")
    return value


@dataclass(frozen=True)
class Link:
    """One link class in the α-β model: a message of S bytes takes ``alpha_s + S / bandwidth``.

    ``alpha_s`` (seconds, ≥ 0) is the latency of one step of a collective over this
    link; ``bandwidth`` (bytes/s, > 0) holds in each direction at once.
    """

    alpha_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        alpha, bandwidth = float(self.alpha_s), float(self.bandwidth)
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"link alpha_s={self.alpha_s!r} must be a finite latency >= 0 seconds")
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"link bandwidth={self.bandwidth!r} must be a finite rate > 0 bytes/s "
                             "(parse_bandwidth reads '100gbit' or '900GB/s')")
        object.__setattr__(self, "alpha_s", alpha)
        object.__setattr__(self, "bandwidth", bandwidth)

    def transfer_s(self, nbytes: float) -> float:
        """Time for one message of ``nbytes`` over this link: α + S/β."""
        return self.alpha_s + nbytes / self.bandwidth

    def to_dict(self) -> dict[str, float]:
        return {"alpha_s": self.alpha_s, "bandwidth": self.bandwidth}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"topology {name}={value!r} must be a positive integer")
    return value


@dataclass(frozen=True)
class Topology:
    """``nodes`` × ``ranks_per_node`` ranks; ``intra`` links inside a node, ``rails`` ×
    ``inter`` links from each node to the network (see the module docstring).

    Ranks are numbered node-major (ranks ``k·ranks_per_node ... (k+1)·ranks_per_node − 1``
    are node ``k``), the order a flat ring follows.
    """

    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    rails: int = 1
    source: str = "described"
    meta: dict[str, Any] = field(default_factory=dict, hash=False)
    #: per all-reduce algorithm, software cost per collective beyond its α-β phases
    #: (seconds; ``commsched probe`` measures it on the real engine; none when described)
    extra_s: dict[str, float] = field(default_factory=dict, hash=False)
    #: per algorithm, seconds per byte beyond the α-β model (an engine slower than its links)
    extra_s_per_byte: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "rails"):
            _positive_int(name, getattr(self, name))
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"topology {name}={getattr(self, name)!r} must be a Link(alpha_s, bandwidth)")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"topology source={self.source!r} must be a non-empty string")
        if not isinstance(self.meta, dict):
            raise ValueError(f"topology meta={self.meta!r} must be a dict")
        if not isinstance(self.extra_s, dict) or any(
                not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 for v in self.extra_s.values()):
            raise ValueError(f"topology extra_s={self.extra_s!r} must map algorithm names to seconds >= 0")
        if not isinstance(self.extra_s_per_byte, dict) or any(
                not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                for v in self.extra_s_per_byte.values()):
            raise ValueError(f"topology extra_s_per_byte={self.extra_s_per_byte!r} must map algorithm names to "
                             "seconds per byte >= 0")

    @property
    def world_size(self) -> int:
        """Number of ranks: ``nodes × ranks_per_node``."""
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        """One line for reports, e.g. ``16x8 (described): intra 900 GB/s α 3.4 µs, inter 12.5 GB/s α 9.6 µs``."""
        def gbs(link: Link) -> str:
            return f"{link.bandwidth / 1e9:.4g} GB/s α {link.alpha_s * 1e6:.3g} µs"
        rails = f" × {self.rails} rails" if self.rails > 1 else ""
        return (f"{self.nodes}x{self.ranks_per_node} ({self.source}): intra {gbs(self.intra)}, "
                f"inter {gbs(self.inter)}{rails}")

    # ------------------------------------------------------------ builders
    @classmethod
    def described(cls, cluster: str, intra: str | float, inter: str | float, rails: int = 1,
                  intra_alpha_s: float = INTRA_ALPHA_S, inter_alpha_s: float = INTER_ALPHA_S) -> "Topology":
        """A cluster from its description: ``cluster`` is ``"NODESxRANKS"`` (``"16x8"``).

        ``intra``: bandwidth between two ranks of a node, per direction; ``inter``: the
        bandwidth of one node's link (one NIC) to the network, per direction; ``rails``:
        NICs per node, each of ``inter``, with rail-aligned rings. Bandwidths go through
        :func:`parse_bandwidth`. Latencies default to NCCL's tuning constants
        (:data:`INTRA_ALPHA_S`, :data:`INTER_ALPHA_S`).
        """
        match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", cluster) if isinstance(cluster, str) else None
        if not match:
            raise ValueError(f"cluster {cluster!r} must be NODESxRANKS, e.g. '16x8' for 16 nodes of 8 ranks")
        return cls(nodes=int(match.group(1)), ranks_per_node=int(match.group(2)),
                   intra=Link(intra_alpha_s, parse_bandwidth(intra)),
                   inter=Link(inter_alpha_s, parse_bandwidth(inter)), rails=rails, source="described",
                   meta={"cluster": cluster.strip(), "intra": str(intra), "inter": str(inter)})

    @classmethod
    def emulated(cls, workers: int, nodes: int | None, bandwidth: str,
                 intra_bandwidth: str | None = None, alpha_s: float = EMULATED_ALPHA_S) -> "Topology":
        """The cluster ``commsched bench --workers N [--nodes M] --bandwidth B
        [--intra-bandwidth B2]`` builds on this machine (:mod:`commsched.bench.netns`).

        * Without ``nodes`` every worker is a node of its own behind one link shaped
          at ``bandwidth`` in each direction (uplink and downlink are two ``tbf``).
          With ``nodes`` M, N/M workers share a node and its loopback.
        * The inter link's payload bandwidth is ``bandwidth / LINK_OVERHEAD``: ``tbf``
          counts Ethernet frames, 0.74 % more than the payload at MTU 9000.
        * Intra: unshaped loopback = :data:`LOOPBACK_BANDWIDTH` (gloo's CPU-bound
          rate). With ``intra_bandwidth`` one ``tbf`` on the node's ``lo`` carries every
          flow between its ranks, a shared bus; a ring inside the node runs
          ``ranks_per_node`` flows at once, so each gets ``B2 / ranks_per_node``.
          ``"none"`` means unshaped, as for the bench.
        * ``alpha_s``: per ring step, on both classes (gloo's software cost dominates).
        """
        workers = _positive_int("workers", workers)
        nodes = workers if nodes is None else _positive_int("nodes", nodes)
        if workers % nodes:
            raise ValueError(f"--workers {workers} must be a multiple of --nodes {nodes} (ranks per node are equal)")
        ranks = workers // nodes
        if str(bandwidth).strip().lower() == "none":
            inter_bw = LOOPBACK_BANDWIDTH
        else:
            inter_bw = parse_bandwidth(bandwidth) / LINK_OVERHEAD
        if intra_bandwidth is None or str(intra_bandwidth).strip().lower() == "none":
            intra_bw = LOOPBACK_BANDWIDTH
        else:
            intra_bw = parse_bandwidth(intra_bandwidth) / _LO_OVERHEAD / ranks
        return cls(nodes=nodes, ranks_per_node=ranks, intra=Link(alpha_s, intra_bw), inter=Link(alpha_s, inter_bw),
                   rails=1, source="emulated",
                   meta={"workers": workers, "nodes": nodes, "bandwidth": str(bandwidth),
                         "intra_bandwidth": None if intra_bandwidth is None else str(intra_bandwidth),
                         "link_overhead": LINK_OVERHEAD})

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``schema``, the counts, each link as ``{alpha_s, bandwidth}``, source, meta."""
        return {"schema": SCHEMA, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "rails": self.rails, "intra": self.intra.to_dict(), "inter": self.inter.to_dict(),
                "source": self.source, "meta": dict(self.meta), "extra_s": dict(self.extra_s),
                "extra_s_per_byte": dict(self.extra_s_per_byte)}

    def to_json(self, path: str) -> None:
        write_json(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Topology":
        """The inverse of :meth:`to_dict`; refuses another schema or a bad field (``ValueError``)."""
        check_schema(data, SCHEMA, "topology", "measure one with `commsched probe --workers N --nodes M "
                     "--bandwidth B --json topo.json` or describe one with `--cluster NODESxRANKS --intra BW "
                     "--inter BW`")
        try:
            return cls(nodes=data["nodes"], ranks_per_node=data["ranks_per_node"], rails=data.get("rails", 1),
                       intra=Link(data["intra"]["alpha_s"], data["intra"]["bandwidth"]),
                       inter=Link(data["inter"]["alpha_s"], data["inter"]["bandwidth"]),
                       source=data.get("source", "unknown"), meta=dict(data.get("meta", {})),
                       extra_s={str(k): float(v) for k, v in data.get("extra_s", {}).items()},
                       extra_s_per_byte={str(k): float(v) for k, v in data.get("extra_s_per_byte", {}).items()})
        except (KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise ValueError(f"the topology is missing or mistypes a field ({exc!r}); see "
                             "commsched.costmodel.topology for the schema") from None

    @classmethod
    def from_json(cls, path: str) -> "Topology":
        return load_json(path, cls.from_dict)
