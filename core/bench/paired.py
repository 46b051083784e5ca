"""Paired ratios between strategies of one ``commsched bench --rounds`` report.

``python -m commsched.bench.paired REPORT.json [--peers ddp,ddp:1,ddp:4,horovod]`` prints, for every
strategy that is not a peer, its speedup over the best peer paired within each round: in round r,
(the peer's median step in round r) / (the strategy's median step in round r), and the median of
those over the rounds. "The best peer" is the peer with the smallest median of rounds; the line
also gives the speedup over the fastest peer *of each round* (a harder bar: the minimum of several
noisy medians is biased low). A ratio whose per-round values straddle 1.0 cannot tell the two apart.

``--by mean`` pairs the rounds' mean steps instead (each round's ``step_times_s``: throughput). Where a
strategy's steps alternate long and short (the cross-iteration path when the link is the bottleneck:
the communication of one step spills into the next), a median of 10 steps falls in either cluster while
the mean is the period the link sets (docs/tuning.md, "The first step after a switch to the reducer").

A round in which the hypervisor took more than ``STOLEN`` of the machine's CPU from the strategy or from
the best peer (the round's ``cpu_steal``, /proc/stat's steal) is marked ``*``: its ratio measures the host
as much as the schedule (a 0.75x round of `planned` on gpt2 ran with 12.5 % of the CPU stolen, its
other two rounds with under 1 %). The ratios keep it; the mark says which to doubt.

This is how the targets of the form "commsched's best >= 0.99x the best of ddp, ddp:1, ddp:4,
horovod" are read off one interleaved run (docs/bench.md, Rounds). With 5 or more rounds (``--interleave``
blocks, typically) the line also gives a 90 % percentile-bootstrap interval of the median paired ratio, and
``--target X`` says for each strategy whether it is shown at or above X (the interval), shown below it, or
cannot be told from X by this run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from typing import Any

from commsched.bench.report import median

DEFAULT_PEERS = ("ddp", "ddp:1", "ddp:4", "horovod")


#: the share of the machine's CPU its hypervisor may take in a round before the round's ratio is marked
STOLEN = 0.05


#: The bootstrap interval of a median paired ratio: its coverage, how many resamples, and the fewest rounds it
#: is given for (with 3 or 4 rounds a resampled median takes only the values already seen).
INTERVAL = 0.90
RESAMPLES = 2000
MIN_ROUNDS_FOR_INTERVAL = 5


def interval(ratios: Sequence[float], coverage: float = INTERVAL, resamples: int = RESAMPLES,
             seed: int = 0) -> tuple[float, float] | None:
    """A percentile-bootstrap interval of the median of ``ratios`` (rounds resampled with replacement; a
    seeded generator, so a report always reads the same), or None with fewer than
    :data:`MIN_ROUNDS_FOR_INTERVAL` ratios. It says how far the host's noise leaves the median: a target
    inside it is neither shown met nor shown missed by that run."""
    if len(ratios) < MIN_ROUNDS_FOR_INTERVAL:
        return None
    rng = random.Random(seed)
    meds = sorted(median([rng.choice(ratios) for _ in ratios]) for _ in range(resamples))
    tail = (1 - coverage) / 2
    return meds[int(tail * (resamples - 1))], meds[int((1 - tail) * (resamples - 1))]


def verdict(span: tuple[float, float] | None, value: float, target: float) -> str:
    """``met`` where the interval (or, without one, the median) is at or above ``target``, ``missed`` where it
    is below, ``cannot tell`` where the interval holds the target."""
    low, high = span if span is not None else (value, value)
    if low >= target:
        return "met"
    if high < target:
        return "missed"
    return "cannot tell"


#: What a round's step is, for pairing: the round's median step (the report's), or the mean of its steps.
BY = ("median", "mean")


def per_round(report: dict[str, Any], by: str = "median") -> dict[str, dict[int, float]]:
    """``{strategy: {round: step s}}`` of the rounds that ran, the round's median step or (``by="mean"``) the
    mean of its ``step_times_s``; refuses a report without rounds, or without the steps a mean needs."""
    if by not in BY:
        raise ValueError(f"by={by!r}: pair the rounds' 'median' or 'mean' step")
    out: dict[str, dict[int, float]] = {}
    for e in report["results"]:
        if e["status"] != "ok":
            continue
        if not e.get("rounds"):
            raise ValueError(f"strategy {e['strategy']!r} has no rounds: measure with commsched bench --rounds 3 "
                             "(or more) so its ratios can be paired within a round")
        ok = [x for x in e["rounds"] if x["status"] == "ok"]
        if by == "mean" and any(not x.get("step_times_s") for x in ok):
            raise ValueError(f"strategy {e['strategy']!r}: its rounds carry no step_times_s (a report from before "
                             "they were kept); pair it by median")
        out[e["strategy"]] = {x["round"]: (x["step_time_s"] if by == "median" else
                                           sum(x["step_times_s"]) / len(x["step_times_s"])) for x in ok}
    return out


def paired(report: dict[str, Any], peers: tuple[str, ...] = DEFAULT_PEERS, by: str = "median") -> dict[str, Any]:
    """For every non-peer strategy: its paired speedups over the best peer and over each round's fastest peer
    (``by``: the rounds' median steps, or their mean steps)."""
    rounds = per_round(report, by)
    present = [p for p in peers if p in rounds]
    if not present:
        raise ValueError(f"none of the peers {', '.join(peers)} ran in this report (it has "
                         f"{', '.join(rounds) or 'no strategy that ran'}); pass --peers")
    best = min(present, key=lambda p: median(list(rounds[p].values())))
    steal = {e["strategy"]: {x["round"]: x.get("cpu_steal") for x in e["rounds"] or []}
             for e in report["results"] if e["status"] == "ok"}

    def stolen(name: str, r: int) -> bool:
        return any((steal[n].get(r) or 0.0) > STOLEN for n in (name, best))
    out: dict[str, Any] = {"best_peer": best, "peers": present, "by": by, "strategies": {}}
    for name, steps in rounds.items():
        if name in present:
            continue
        common = [r for r in sorted(steps) if r in rounds[best]]
        vs_best = [rounds[best][r] / steps[r] for r in common]
        each = [r for r in sorted(steps) if all(r in rounds[p] for p in present)]
        vs_fastest = [min(rounds[p][r] for p in present) / steps[r] for r in each]
        out["strategies"][name] = {
            "vs_best_peer": median(vs_best), "vs_best_peer_rounds": vs_best,
            "vs_best_peer_interval": interval(vs_best),
            "vs_fastest_peer_each_round": median(vs_fastest), "rounds": len(common),
            "round_numbers": common, "stolen_rounds": [r for r in common if stolen(name, r)]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commsched.bench.paired", description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a commsched bench JSON measured with --rounds")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help=f"the strategies to beat, comma-separated (default {','.join(DEFAULT_PEERS)})")
    parser.add_argument("--by", choices=BY, default="median",
                        help="pair each round's median step (default) or the mean of its steps (throughput)")
    parser.add_argument("--target", type=float, default=None, metavar="X",
                        help="also say whether each strategy is shown at least X times the best peer: met (the "
                             f"{INTERVAL:.0%} bootstrap interval of its median paired ratio is at or above X), missed "
                             "(below), or cannot tell (the interval holds X)")
    args = parser.parse_args(argv)
    try:
        with open(args.report) as fh:
            report = json.load(fh)
        result = paired(report, tuple(p.strip() for p in args.peers.split(",") if p.strip()), args.by)
    except (OSError, ValueError, KeyError) as exc:
        print(f"commsched.bench.paired: {args.report}: {exc}", file=sys.stderr)
        return 2
    cfg = report["config"]
    print(f"{cfg['workload']}, {cfg['workers']} workers, {cfg['bandwidth'] or 'unshaped'} ({report['emulation']}): "
          f"best peer {result['best_peer']} (of {', '.join(result['peers'])}), rounds paired by {args.by} step")
    marked = False
    for name, r in result["strategies"].items():
        rounds = ", ".join(f"{v:.3f}" + ("*" if rn in r["stolen_rounds"] else "")
                           for rn, v in zip(r["round_numbers"], r["vs_best_peer_rounds"], strict=True))
        marked = marked or bool(r["stolen_rounds"])
        span = r["vs_best_peer_interval"]
        within = f", {INTERVAL:.0%} interval {span[0]:.3f}-{span[1]:.3f}" if span is not None else ""
        target = "" if args.target is None else \
            f"; >= {args.target:g}x: {verdict(span, r['vs_best_peer'], args.target)}"
        print(f"  {name}: {r['vs_best_peer']:.3f}x {result['best_peer']} (rounds {rounds}{within}); "
              f"{r['vs_fastest_peer_each_round']:.3f}x the fastest peer of each round{target}")
    if marked:
        print(f"  * the hypervisor took more than {STOLEN:.0%} of the CPU in that round (cpu_steal of the strategy "
              f"or of {result['best_peer']}): a ratio of the host as much as of the schedule")
    return 0


if __name__ == "__main__":
    sys.exit(main())
