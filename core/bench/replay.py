"""Replay a bench run's timelines on the cost model's network: how much of the step the network explains.

``commsched bench --timeline DIR`` writes the trace of every rank of each commsched strategy
(``DIR/<strategy>.rank<r>.json``). For every piece they give, on each rank, when it was ready
(the start of its ``QUEUED`` span), issued (the start of ``COMM``) and landed (the end of
``COMM``; the traces' clock is ``perf_counter``, one clock for every rank of the emulated cluster,
which runs on one machine: traces of ranks on different machines cannot be compared so). The replay
starts each piece when the last rank has issued it, holds the topology's
slow link class (the inter-node link on several nodes, else the intra-node one) for the piece's
closed-form time there (:func:`commsched.costmodel.collectives.allreduce_phases`; the phases on
other links are a delay before and after), one piece after another in the order they reach the
link, and compares each step's last landing with the one measured.

Where the two agree, the network model holds for that run, and a prediction's error lies in when
the ranks issue their pieces (compute, the ranks' skew, the credit), which the replay reads from the
traces instead of predicting. It also splits the link's idle time in the measured steps: *held*,
while some piece was ready on every rank and not yet issued on all of them (the credit, a fixed
order, the dispatch thread's wake-up), and *starved*, while no piece was ready on every rank (the
step boundary, the slowest rank's compute). ``python -m commsched.bench.replay DIR --strategy S
--workers N [--nodes M] --bandwidth B [--algorithm hierarchical]`` prints it (docs/bench.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from commsched.bench.spec import file_safe
from commsched.costmodel.collectives import ALGORITHMS, allreduce_phases
from commsched.costmodel.profile import merged_spans, overlap_s
from commsched.costmodel.topology import Topology

__all__ = ["PieceTimes", "ReplayResult", "StepReplay", "load_pieces", "main", "replay"]


@dataclass(frozen=True)
class PieceTimes:
    """One piece of one step, as every rank's trace recorded it (seconds; one clock for all ranks)."""

    step: int
    name: str
    nbytes: int
    ready: tuple[float, ...]  # per rank: the start of its QUEUED span
    issue: tuple[float, ...]  # per rank: the start of its COMM span
    land: tuple[float, ...]   # per rank: the end of its COMM span


@dataclass(frozen=True)
class StepReplay:
    """One step: its last landing measured (on the last rank) and replayed, seconds from the first issue."""

    step: int
    pieces: int
    measured_s: float
    replayed_s: float

    @property
    def error_s(self) -> float:
        """Measured minus replayed: what the network model leaves unexplained in this step's end."""
        return self.measured_s - self.replayed_s


@dataclass(frozen=True)
class ReplayResult:
    steps: tuple[StepReplay, ...]
    link: str             # the link class replayed: "inter" or "intra"
    window_s: float       # from the first replayed link start of the second step to the last link end
    busy_s: float         # the link busy in that window
    held_s: float         # idle while a piece was ready on every rank and not issued on all
    starved_s: float      # idle while no piece was ready on every rank

    def to_dict(self) -> dict[str, Any]:
        steps = [dict(asdict(s), error_s=s.error_s) for s in self.steps]
        return {"link": self.link, "window_s": self.window_s, "busy_s": self.busy_s, "held_s": self.held_s,
                "starved_s": self.starved_s, "steps": steps}


def _spans(path: str) -> dict[tuple[int, str], dict[str, Any]]:
    try:
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    except OSError as exc:
        raise ValueError(f"cannot read the timeline {path} ({exc.strerror or exc}); write it with commsched bench "
                         "... --timeline DIR, every rank's trace of the strategy in DIR") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a commsched timeline (Chrome trace JSON with traceEvents): {exc}") from exc
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("QUEUED", "COMM"):
            continue
        args = e.get("args") or {}
        if "step" not in args:
            continue
        piece = out.setdefault((int(args["step"]), str(e["name"])), {})
        start = float(e["ts"]) / 1e6
        if e["cat"] == "QUEUED":
            piece["ready"] = start
        else:
            piece["issue"], piece["land"] = start, start + float(e.get("dur", 0.0)) / 1e6
            piece["bytes"] = int(args.get("bytes", 0))
    return out


def load_pieces(directory: str, strategy: str, world_size: int) -> list[PieceTimes]:
    """The pieces every rank's trace of ``strategy`` in ``directory`` holds, in the order they were first issued.

    Raises ``ValueError`` naming the file that is missing or unreadable, and when the traces share no piece.
    """
    if world_size < 2:
        raise ValueError(f"--workers {world_size}: a replay needs the traces of at least 2 ranks")
    ranks = [_spans(os.path.join(directory, f"{file_safe(strategy)}.rank{r}.json")) for r in range(world_size)]
    pieces = []
    for key, first in ranks[0].items():
        seen = [r.get(key) for r in ranks]
        if any(s is None or "issue" not in s for s in seen):
            continue
        pieces.append(PieceTimes(step=key[0], name=key[1], nbytes=first["bytes"],
                                 ready=tuple(s.get("ready", s["issue"]) for s in seen),
                                 issue=tuple(s["issue"] for s in seen), land=tuple(s["land"] for s in seen)))
    if not pieces:
        raise ValueError(f"the {world_size} traces of {strategy!r} in {directory} share no piece: were they "
                         "written by one run (commsched bench --timeline DIR)?")
    return sorted(pieces, key=lambda p: (min(p.issue), p.step, p.name))


def _split(topology: Topology, nbytes: int, algorithm: str) -> tuple[str, float, float, float]:
    """(link class, seconds before it, on it, after it) of one all-reduce of ``nbytes``."""
    link = "inter" if topology.nodes > 1 else "intra"
    before = held = after = 0.0
    for phase in allreduce_phases(topology, nbytes, algorithm):
        if link in phase.links:
            held += phase.seconds
        elif held == 0.0:
            before += phase.seconds
        else:
            after += phase.seconds
    return link, before, held, after


def replay(pieces: Sequence[PieceTimes], topology: Topology, algorithm: str = "ring") -> ReplayResult:
    """Replay ``pieces`` (:func:`load_pieces`) on ``topology``'s slow link with ``algorithm``'s closed form."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r}: one of {', '.join(ALGORITHMS)}")
    if not pieces:
        raise ValueError("nothing to replay: no pieces")
    link = ""
    arrivals = []
    for p in pieces:
        link, before, held, after = _split(topology, p.nbytes, algorithm)
        arrivals.append((max(p.issue) + before, held, after, p))
    arrivals.sort(key=lambda a: a[0])
    free = -float("inf")
    busy: list[tuple[float, float]] = []
    replayed: dict[int, float] = {}
    for arrive, held, after, p in arrivals:
        start = max(arrive, free)
        free = start + held
        busy.append((start, free))
        replayed[p.step] = max(replayed.get(p.step, -float("inf")), free + after)
    origin = min(min(p.issue) for p in pieces)
    by_step: dict[int, list[PieceTimes]] = {}
    for p in pieces:
        by_step.setdefault(p.step, []).append(p)
    steps = tuple(StepReplay(step=s, pieces=len(ps), measured_s=max(max(p.land) for p in ps) - origin,
                             replayed_s=replayed[s] - origin) for s, ps in sorted(by_step.items()))
    # the link's idle time from the second step's first piece on the link to the end
    first_step = steps[0].step
    later = [b for b, (_, _, _, p) in zip(busy, arrivals, strict=True) if p.step != first_step]
    if not later:
        return ReplayResult(steps, link, 0.0, 0.0, 0.0, 0.0)
    t0, t1 = min(a for a, _ in later), max(b for _, b in busy)
    merged = [(max(a, t0), b) for a, b in merged_spans(busy) if b > t0]
    waiting = merged_spans((max(p.ready), max(p.issue)) for p in pieces)
    held_s = starved_s = 0.0
    for (_, gap_start), (gap_end, _) in zip(merged, merged[1:], strict=False):
        covered = overlap_s(waiting, (gap_start, gap_end))
        held_s += covered
        starved_s += gap_end - gap_start - covered
    busy_s = sum(b - a for a, b in merged)
    return ReplayResult(steps, link, t1 - t0, busy_s, held_s, starved_s)


def _format(result: ReplayResult, strategy: str, algorithm: str, topology: Topology) -> str:
    lines = [f"{strategy}: {len(result.steps)} steps replayed on the {result.link}-node link of "
             f"{topology.describe()}, {algorithm} closed form",
             "| step | pieces | last landing measured s | replayed s | measured - replayed ms |",
             "|---:|---:|---:|---:|---:|"]
    for s in result.steps:
        lines.append(f"| {s.step} | {s.pieces} | {s.measured_s:.3f} | {s.replayed_s:.3f} | {1e3 * s.error_s:+.1f} |")
    if result.window_s > 0:
        n = len(result.steps) - 1  # the first has no step before it to overlap with
        idle = result.window_s - result.busy_s
        lines.append(f"after the first step ({n} steps, {result.window_s:.2f} s): the link busy {result.busy_s:.2f} s "
                     f"({result.busy_s / result.window_s:.0%}); idle {idle:.2f} s, of it held {result.held_s:.2f} s "
                     f"(a piece ready on every rank, not yet issued on all) and starved {result.starved_s:.2f} s "
                     "(no piece ready on every rank)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commsched.bench.replay", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the --timeline DIR of a commsched bench run")
    parser.add_argument("--strategy", required=True, help="a commsched strategy of that run (its traces' name)")
    parser.add_argument("--workers", type=int, required=True, help="ranks of that run")
    parser.add_argument("--nodes", type=int, default=None, help="nodes of that run (default: one rank per node)")
    parser.add_argument("--bandwidth", required=True, help="that run's --bandwidth (none: unshaped)")
    parser.add_argument("--intra-bandwidth", default=None, help="that run's --intra-bandwidth")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="ring",
                        help="the closed form of every piece (hierarchical: the two-level pieces of planned or "
                             "hierarchical; default ring)")
    parser.add_argument("--json", default=None, help="also write the replay here")
    args = parser.parse_args(argv)
    try:
        topology = Topology.emulated(args.workers, args.nodes, args.bandwidth, args.intra_bandwidth)
        result = replay(load_pieces(args.directory, args.strategy, args.workers), topology, args.algorithm)
    except ValueError as exc:
        print(f"commsched.bench.replay: {exc}", file=sys.stderr)
        return 2
    print(_format(result, args.strategy, args.algorithm, topology))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(result.to_dict(), strategy=args.strategy, algorithm=args.algorithm,
                           topology=topology.to_dict()), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
