"""``commsched probe``: measure the emulated cluster's links with gloo and fit α-β per link class.

On the cluster ``commsched bench`` builds for the same flags (:mod:`commsched.bench.netns`,
one phase of its runner with this module as the worker), every rank joins one gloo
job and sweeps message sizes from 4 KiB to 64 MiB (×4 per step, :data:`SIZES`):

* ``intra`` (ranks of node 0, when a node has ≥ 2): a ring all-reduce on their group
  and a ping-pong between ranks 0 and 1;
* ``inter`` (local rank 0 of every node, when there are ≥ 2 nodes): a ring all-reduce
  on their group and a ping-pong between rank 0 and the first rank of node 1;
* ``world``: the all-reduce of all ranks (the bench's ``comm``), kept as a check.

Each point is the median of ``repeats`` runs after one warm-up, every run behind a
barrier; an all-reduce's time is the slowest member's median, as the bench's ``comm_s``.
α and β of a class come from its all-reduce points with the ring coefficients (what
the simulator predicts with them), over the sizes of at least 16 ``tbf`` bursts for β
(a smaller message passes mostly within the burst, at line rate, which would bias β
up) and the sizes up to 64 KiB for α: α is the median time per ring step of those
small sizes, β the median of what each large size implies with that α
(:func:`_robust_bandwidth`: one size disturbed by other load does not move it). The
weighted least-squares fits (:func:`commsched.costmodel.fit.fit_link`) of the large
sizes, of all sizes and of the ping-pongs are kept in ``meta``. A class this cluster
does not have (one rank per node: no intra pairs) keeps the configured value of
:meth:`Topology.emulated`, and ``meta`` says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from typing import Any

from commsched.costmodel.fit import LinkFit, Sample, fit_link, ping_pong, ring_allreduce
from commsched.costmodel.topology import Link, Topology

__all__ = ["SIZES", "add_arguments", "cached_probe", "probe", "run", "save_probe"]

#: Where ``commsched probe`` also keeps each topology it measured, one per cluster's flags (the
#: benchmark's ``planned`` strategy plans on it when there is one).
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "commsched", "topologies")

#: Message sizes of the sweep, bytes: 4 KiB, 16 KiB, ..., 64 MiB.
SIZES = tuple(4096 * 4 ** k for k in range(8))
DEFAULT_REPEATS = 5
#: A point further than this (relative) from the fit is dropped as disturbed by other load, down
#: to 4 points per fit; meta lists them. On a quiet machine none is.
MAX_RESIDUAL = 0.25
#: Messages up to this size measure the latency α (their transfer is µs at line rate).
LATENCY_MAX_BYTES = 64 * 1024


# ------------------------------------------------------------------------- the parent
def probe(workers: int, nodes: int | None, bandwidth: str | None, intra_bandwidth: str | None = None, *,
          network: str = "netns", repeats: int = DEFAULT_REPEATS, sizes: tuple[int, ...] = SIZES,
          timeout_s: float = 300.0, log_stream: Any = sys.stderr) -> Topology:
    """Measure and fit the cluster of these flags; the :class:`Topology` with the raw points in ``meta``.

    Raises ``ValueError`` on bad flags (before any namespace exists) and
    ``RuntimeError`` when the measurement failed (its logs are named).
    """
    from commsched.bench.netns import NetworkSetupError, make_cluster, parse_rate
    from commsched.bench.procs import signals_raise
    from commsched.bench.runner import RunConfig, Runner, make_work_dir

    nodes = workers if nodes is None else nodes
    if workers < 1 or nodes < 1 or workers % nodes:
        raise ValueError(f"--nodes {nodes} must divide --workers {workers} (e.g. --workers 4 --nodes 2)")
    if workers < 2:
        raise ValueError("--workers must be >= 2: one rank has no link to measure")
    bandwidth = None if parse_rate(bandwidth) is None else bandwidth
    intra_bandwidth = None if parse_rate(intra_bandwidth) is None else intra_bandwidth
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    configured = Topology.emulated(workers, nodes, bandwidth or "none", intra_bandwidth)
    config = RunConfig(workload="tiny", workers=workers, nodes=nodes, bandwidth=bandwidth,
                       intra_bandwidth=intra_bandwidth, strategies=[], steps=repeats, warmup=1, batch_size=1,
                       partition_bytes=1 << 20, credit_bytes=4 << 20, network=network, phase_timeout_s=timeout_s)
    cluster = make_cluster(network, nodes, bandwidth, intra_bandwidth)
    work_dir = make_work_dir()
    with open(os.path.join(work_dir, "sizes.json"), "w") as f:
        json.dump(list(sizes), f)
    started = time.monotonic()
    try:
        with signals_raise(), cluster:
            runner = Runner(config, cluster, work_dir, worker_module=__name__, log=log_stream)
            phase = runner.run_phase(0, "probe", "probe")
    except NetworkSetupError as exc:
        raise RuntimeError(f"cannot build the emulated network: {exc} (use --network loopback)") from exc
    if phase.status != "ok":
        raise RuntimeError(f"the probe failed: {phase.reason} (logs in {work_dir})")
    points = _points(phase.ranks)
    topo = _fit(points, workers, nodes, configured, bandwidth, intra_bandwidth, cluster,
                time.monotonic() - started)
    shutil.rmtree(work_dir, ignore_errors=True)
    return topo


def _points(ranks: list[dict]) -> dict[str, list[dict]]:
    """Per measurement kind, one point per size: the slowest participant's median."""
    out: dict[str, list[dict]] = {}
    for kind in ranks[0]["kinds"]:
        rows = []
        for i, size in enumerate(ranks[0]["sizes"]):
            meds = [_median(r["times"][kind][i]) for r in ranks if r["times"].get(kind) and r["times"][kind][i]]
            rows.append({"bytes": size, "time_s": max(meds), "n": ranks[0]["kinds"][kind]})
        out[kind] = rows
    return out


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _samples(rows: list[dict], kind: str) -> list[Sample]:
    if kind.endswith("pingpong"):
        return [ping_pong(r["bytes"], r["time_s"]) for r in rows]
    return [ring_allreduce(r["n"], r["bytes"], r["time_s"]) for r in rows]


def _fit_info(fit: LinkFit, rows: list[dict]) -> dict[str, Any]:
    kept = [r for i, r in enumerate(fit.residuals) if i not in fit.dropped]
    return {"alpha_s": fit.alpha_s, "bandwidth": fit.bandwidth, "alpha_clamped": fit.alpha_clamped,
            "rms_residual": (sum(r * r for r in kept) / len(kept)) ** 0.5,
            "outliers": [rows[i]["bytes"] for i in fit.dropped],
            "residuals": {str(r["bytes"]): res for r, res in zip(rows, fit.residuals, strict=True)}}


def _fit(points: dict[str, list[dict]], workers: int, nodes: int, configured: Topology, bandwidth: str | None,
         intra_bandwidth: str | None, cluster: Any, wall_s: float) -> Topology:
    from commsched.bench.netns import BURST_BYTES, parse_rate

    fits: dict[str, Any] = {}
    links: dict[str, Link] = {}
    rates = {"inter": parse_rate(bandwidth), "intra": parse_rate(intra_bandwidth)}
    if "inter_allreduce" not in points and nodes >= 2 and workers == nodes:
        points = {**points, "inter_allreduce": points["world_allreduce"]}  # one rank per node: the same ring
    for cls in ("intra", "inter"):
        # tc tbf lets a burst through at line rate: below ~16 bursts a message mostly is one
        bits = rates[cls]
        shaped_min = 16 * max(BURST_BYTES, int(bits / 8 / 1000)) if bits else 0
        shaped_rows: dict[str, list[dict]] = {}
        for kind in (f"{cls}_allreduce", f"{cls}_pingpong"):
            if kind not in points:
                continue
            rows = points[kind]
            fits[kind] = _fit_info(fit_link(_samples(rows, kind), MAX_RESIDUAL), rows)
            big = [r for r in rows if r["bytes"] >= shaped_min] or rows[-2:]
            big = shaped_rows[kind] = big if len(big) >= 2 else rows[-2:]
            small = [r for r in rows if r["bytes"] <= LATENCY_MAX_BYTES]
            fits[f"{kind}_shaped"] = _fit_info(fit_link(_samples(big, kind)), big)
            if small:  # their bytes take µs at line rate: the time is the steps' latency (median: robust to load)
                per_step = [x.time_s / x.c_alpha for x in _samples(small, kind)]
                fits[f"{kind}_latency"] = {"alpha_s": _median(per_step), "per_step_s": per_step,
                                           "bytes": [r["bytes"] for r in small]}
        chosen = fits.get(f"{cls}_allreduce_shaped")
        if chosen is not None:
            latency = fits.get(f"{cls}_allreduce_latency", chosen)
            kind = f"{cls}_allreduce"
            robust = _robust_bandwidth(_samples(shaped_rows[kind], kind), latency["alpha_s"])
            fits[f"{cls}_allreduce_robust"] = robust
            links[cls] = Link(latency["alpha_s"], robust["bandwidth"] or chosen["bandwidth"])
        else:
            links[cls] = getattr(configured, cls)
            fits[cls] = "not measured (this cluster has no such pair): the configured value"
    if "world_allreduce" in points:
        fits["world_allreduce"] = _fit_info(fit_link(_samples(points["world_allreduce"], "world"), MAX_RESIDUAL),
                                            points["world_allreduce"])
    meta = {
        "workers": workers, "nodes": nodes, "bandwidth": bandwidth, "intra_bandwidth": intra_bandwidth,
        "emulation": cluster.emulation, "emulation_note": cluster.note, "wall_s": wall_s,
        "how": "each class from its ring all-reduce sweep, t = 2(n-1) alpha + 2(n-1)/n S / beta, weighted least "
               "squares (relative residuals): beta from the sizes >= 16 tbf bursts (<kind>_shaped; smaller "
               "messages pass mostly within the burst, at line rate), alpha from the sizes <= 64 KiB "
               "(<kind>_latency: the median of t / (2(n-1)), robust to other load), the beta used the median of "
               "what each shaped size implies with that alpha (<cls>_allreduce_robust); the fit over all sizes "
               "and the ping-pong fits (t = 2 alpha + S / beta) beside",
        "points": points, "fits": fits,
        "configured": {"intra": configured.intra.to_dict(), "inter": configured.inter.to_dict()},
        "beta_vs_configured": {cls: links[cls].bandwidth / getattr(configured, cls).bandwidth
                               for cls in ("intra", "inter")},
    }
    fitted = Topology(nodes=nodes, ranks_per_node=workers // nodes, intra=links["intra"], inter=links["inter"],
                      rails=1, source="probe", meta=meta)
    extra = _engine_extra(points, fitted)
    meta["extra_s_points"] = extra.pop("points")
    per_byte = extra.pop("per_byte", {})
    meta["how"] += ("; extra_s / extra_s_per_byte: per algorithm, the world all-reduce measured minus the alpha-beta "
                    "model of the fitted links: the median of the sizes <= 1 MiB (per collective) and the slope of the "
                    "two largest sizes (per byte), clamped at 0: the engine's own cost")
    return Topology(nodes=fitted.nodes, ranks_per_node=fitted.ranks_per_node, intra=fitted.intra, inter=fitted.inter,
                    rails=1, source="probe", meta=meta, extra_s=extra, extra_s_per_byte=per_byte)


def _robust_bandwidth(samples: list[Sample], alpha_s: float) -> dict[str, Any]:
    """β as the median over ``samples`` of what each one implies with the latency fixed at
    ``alpha_s``: ``c_β / (t − c_α·α)``. One disturbed size among three moves a least-squares
    β by its whole error; it moves the median not at all. ``bandwidth`` is ``None`` when no
    sample is slower than its latency alone."""
    implied = [x.c_bytes / (x.time_s - x.c_alpha * alpha_s) for x in samples
               if x.c_bytes > 0 and x.time_s > x.c_alpha * alpha_s]
    return {"bandwidth": _median(implied) if implied else None, "per_point": implied,
            "how": "median over the shaped sizes of c_beta / (t - c_alpha * alpha), alpha from the latency sizes"}


def _engine_extra(points: dict[str, list[dict]], fitted: Topology) -> dict[str, Any]:
    """What the world's all-reduces cost beyond the α-β model of the fitted links, per algorithm."""
    from commsched.costmodel.collectives import allreduce_s

    extra: dict[str, Any] = {"points": {}}
    two_level = fitted.nodes > 1 and fitted.ranks_per_node > 1
    for kind, algorithm in (("world_allreduce", "ring"), ("world_hierarchical", "hierarchical")):
        if kind not in points or (algorithm == "hierarchical" and not two_level):
            continue
        rows = points[kind]
        diffs = [r["time_s"] - allreduce_s(fitted, r["bytes"], algorithm) for r in rows]
        extra["points"][algorithm] = {str(r["bytes"]): d for r, d in zip(rows, diffs, strict=True)}
        small = [d for r, d in zip(rows, diffs, strict=True) if r["bytes"] <= 1 << 20] or diffs
        fixed = max(0.0, _median(small))
        big = rows[-2:]  # the slope of the two largest sizes: an engine slower than its links
        slope = 0.0
        if len(big) == 2 and big[1]["bytes"] > big[0]["bytes"]:
            d0, d1 = diffs[-2], diffs[-1]
            slope = max(0.0, (d1 - d0) / (big[1]["bytes"] - big[0]["bytes"]))
        extra[algorithm] = fixed
        extra.setdefault("per_byte", {})[algorithm] = slope
    return extra


# ------------------------------------------------------------------------- the worker
def _worker_main(argv: list[str] | None = None) -> int:
    """One rank of the probe (started through the bench's runner, inside its node)."""
    import datetime

    import torch
    import torch.distributed as dist

    from commsched.plugins.torch.bench import worker

    spec, rank = worker.start_rank(argv, "commsched probe worker (started by commsched probe)")
    world, nodes = spec["world_size"], spec["nodes"]
    per_node = world // nodes
    with open(os.path.join(os.path.dirname(spec["run_dir"]), "sizes.json")) as f:
        sizes = json.load(f)
    repeats, warmup = spec["steps"], spec["warmup"]
    progress = worker.Progress(spec["run_dir"], rank == 0)
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec["collective_timeout_s"]))
        intra_ranks = list(range(per_node))
        inter_ranks = [k * per_node for k in range(nodes)]
        # new_group is collective: every rank creates every group, in the same order
        intra = dist.new_group(intra_ranks) if per_node >= 2 else None
        inter = dist.new_group(inter_ranks) if nodes >= 2 and per_node >= 2 else None
        kinds: dict[str, int] = {"world_allreduce": world}
        if intra is not None:
            kinds.update(intra_allreduce=per_node, intra_pingpong=2)
        if inter is not None:  # with one rank per node the world ring *is* the ring of the nodes
            kinds["inter_allreduce"] = nodes
        if nodes >= 2:
            kinds["inter_pingpong"] = 2
        hier = None
        if nodes >= 2 and per_node >= 2:  # the two-level algorithm as commsched runs it (its 3-thread pipeline)
            from commsched.plugins.torch.hierarchical import HierarchicalAllReduce

            hier = HierarchicalAllReduce(nodes, per_node, timeout_s=spec["collective_timeout_s"])
            kinds["world_hierarchical"] = world
        times: dict[str, list[list[float]]] = {k: [[] for _ in sizes] for k in kinds}
        answer = torch.zeros(1)

        def allreduce(group: Any, members: list[int], buf: torch.Tensor) -> float | None:
            if rank not in members:
                return None
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            return time.perf_counter() - t0

        def pingpong(peer_a: int, peer_b: int, buf: torch.Tensor) -> float | None:
            if rank == peer_a:
                t0 = time.perf_counter()
                dist.send(buf, peer_b)
                dist.recv(answer, peer_b)
                return time.perf_counter() - t0
            if rank == peer_b:
                dist.recv(buf, peer_a)
                dist.send(answer, peer_a)
            return None

        def two_level(buf: torch.Tensor) -> float:
            finished = threading.Event()
            errors: list[BaseException] = []

            def done(exc: BaseException | None) -> None:
                if exc is not None:
                    errors.append(exc)
                finished.set()
            t0 = time.perf_counter()
            hier.start(buf, done, "probe")
            if not finished.wait(spec["collective_timeout_s"]):
                raise TimeoutError("the two-level all-reduce of the probe did not finish")
            if errors:
                raise errors[0]
            return time.perf_counter() - t0

        ops = {
            "world_hierarchical": two_level,
            "world_allreduce": lambda buf: allreduce(None, list(range(world)), buf),
            "intra_allreduce": lambda buf: allreduce(intra, intra_ranks, buf),
            "intra_pingpong": lambda buf: pingpong(0, 1, buf),
            "inter_allreduce": lambda buf: allreduce(inter, inter_ranks, buf),
            "inter_pingpong": lambda buf: pingpong(0, per_node, buf),
        }
        total = len(sizes) * len(kinds)
        for i, size in enumerate(sizes):
            buf = torch.zeros(size // 4)
            for k, kind in enumerate(kinds):
                op = ops[kind]
                for rep in range(warmup + repeats):
                    dist.barrier()
                    took = op(buf)
                    if took is not None and rep >= warmup:
                        times[kind][i].append(took)
                progress("sweep", i * len(kinds) + k + 1, total)
        dist.barrier()
        if hier is not None:
            hier.close()
        result = {"rank": rank, "sizes": sizes, "kinds": kinds, "times": times}
    except Exception:  # noqa: BLE001 - any failure: print it, exit non-zero at once (peers then fail fast)
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    worker._write_json(os.path.join(spec["run_dir"], f"rank{rank}.json"), result)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the bench worker: gloo may abort in interpreter teardown


# ------------------------------------------------------------------------------- CLI
def _rate(text: str) -> str:
    from commsched.bench.netns import parse_rate
    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``--workers --nodes --bandwidth --intra-bandwidth --network``, as ``commsched bench`` reads them."""
    parser.add_argument("--workers", type=_positive, default=2, help="data-parallel ranks (default 2)")
    parser.add_argument("--nodes", type=_positive, default=None,
                        help="emulated machines; must divide --workers (default: one node per worker)")
    parser.add_argument("--bandwidth", type=_rate, default="1gbit",
                        help="rate of every node link, each direction, as tc writes it (1gbit, 500mbit) "
                             "or 'none' (default 1gbit)")
    parser.add_argument("--intra-bandwidth", type=_rate, default="none",
                        help="rate shared by all traffic between workers of one node, or 'none' (default)")
    parser.add_argument("--network", choices=("netns", "loopback"), default="netns",
                        help="netns: shaped namespaces (needs root; falls back to loopback); loopback: unshaped")


def _cache_file(workers: int, nodes: int | None, bandwidth: str | None, intra_bandwidth: str | None,
                network: str, cache_dir: str | None) -> str:
    from commsched.bench.netns import parse_rate

    nodes = workers if nodes is None else nodes
    rates = [parse_rate(bandwidth), parse_rate(intra_bandwidth)]
    key = f"{network}-{workers}w-{nodes}n-{rates[0] or 'none'}-{rates[1] or 'none'}.json"
    return os.path.join(cache_dir or CACHE_DIR, key)


def save_probe(topo: Topology, network: str = "netns", cache_dir: str | None = None) -> str:
    """Keep ``topo`` (a probe's result) in the cache under its cluster's flags; returns the path."""
    meta = topo.meta
    path = _cache_file(meta["workers"], meta["nodes"], meta["bandwidth"], meta["intra_bandwidth"], network, cache_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    topo.to_json(path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def cached_probe(workers: int, nodes: int | None, bandwidth: str | None, intra_bandwidth: str | None = None,
                 network: str = "netns", cache_dir: str | None = None) -> Topology | None:
    """The topology ``commsched probe`` last measured for these flags, or None."""
    path = _cache_file(workers, nodes, bandwidth, intra_bandwidth, network, cache_dir)
    if not os.path.exists(path):
        return None
    try:
        return Topology.from_json(path)
    except ValueError:
        return None  # an older or broken entry: as if there were none


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``commsched probe`` flags."""
    parser.description = ("Measure the emulated cluster `commsched bench` builds for these flags with gloo "
                          "all-reduce and send/recv sweeps (4 KiB - 64 MiB) and fit alpha (latency) and beta "
                          "(bandwidth) per link class.")
    add_cluster_arguments(parser)
    parser.add_argument("--repeats", type=_positive, default=DEFAULT_REPEATS,
                        help=f"timed runs per size, after one warm-up (default {DEFAULT_REPEATS})")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the workers are killed")
    parser.add_argument("--json", required=True, metavar="PATH", help="write the topology here")


def run(args: argparse.Namespace) -> int:
    """``commsched probe``: 0 when the topology is written, 1 when measuring failed, 2 on bad flags."""
    try:
        topo = probe(args.workers, args.nodes, args.bandwidth, args.intra_bandwidth, network=args.network,
                     repeats=args.repeats, timeout_s=args.timeout)
    except ValueError as exc:
        print(f"commsched probe: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"commsched probe: {exc}", file=sys.stderr)
        return 1
    topo.to_json(args.json)
    cached = save_probe(topo, topo.meta.get("emulation") or args.network)
    print(format_topology(topo))
    print(f"kept for the benchmark's planned strategy in {cached}")
    return 0


def format_topology(topo: Topology) -> str:
    """The fitted links against the configured ones, as ``commsched probe`` prints them."""
    meta = topo.meta
    rows = [f"{'class':<6} {'alpha us':>9} {'beta MB/s':>10} {'configured MB/s':>16} {'beta/conf':>9} {'rms res':>8}"]
    for cls in ("intra", "inter"):
        link, conf = getattr(topo, cls), meta["configured"][cls]
        fit = meta["fits"].get(f"{cls}_allreduce_shaped")
        res = f"{fit['rms_residual']:.3f}" if isinstance(fit, dict) else "-"
        note = "" if isinstance(fit, dict) else "  (not measured: configured)"
        rows.append(f"{cls:<6} {link.alpha_s * 1e6:9.1f} {link.bandwidth / 1e6:10.1f} {conf['bandwidth'] / 1e6:16.1f} "
                    f"{link.bandwidth / conf['bandwidth']:9.3f} {res:>8}{note}")
    for algorithm, seconds in sorted(topo.extra_s.items()):
        slope = topo.extra_s_per_byte.get(algorithm, 0.0) * (1 << 20)
        rows.append(f"{algorithm} all-reduce of the world: {seconds * 1e3:.2f} ms per collective + {slope * 1e3:.2f} "
                    "ms per MiB beyond the alpha-beta model (extra_s, extra_s_per_byte)")
    rows.append(f"{topo.describe()}; {meta['emulation_note']}; probe took {meta['wall_s']:.0f} s")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(_worker_main())
