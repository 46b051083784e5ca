#!/usr/bin/env python3
"""Where a communication-bound step loses time against the link, from the ranks' timelines
(docs/tuning.md, "comm-heavy: the floor of a cross-iteration step").

Reads the Chrome traces one commsched strategy wrote on every rank (``commsched bench
--timeline DIR``: ``DIR/<strategy>.rank<r>.json``) and prints, per measured step:

* in flight: the share of the step (rank 0's step marks) during which some piece of rank 0 was
  between its issue and its landing, and the idle time in between;
* the step boundary: after the last piece of step k landed, on each rank, when the waiting
  forward woke, how long the updates took before the first gradient of step k+1 was ready,
  when that was, and when the first piece of at least ``--big`` bytes of step k+1 was ready
  (the link has little to carry before it);
* the follower's lag: for pieces the follower had ready before rank 0 issued them, the
  follower's issue minus rank 0's (the decision's trip, ``dynamic``; ~0 under ``static``).

    python scripts/step_boundary.py DIR dynamic_2MiB_8MiB [--skip 3] [--big 1048576] [--json out.json]

All ranks of the emulated cluster run on one machine, so their timestamps share one clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any


def _events(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    start = None
    for s, t in sorted(spans):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, t
        else:
            end = max(end, t)
    if end is not None:
        total += end - start
    return total / 1e3


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def analyse(ranks: list[list[dict[str, Any]]], skip: int, big: int) -> dict[str, Any]:
    """The per-step figures and their medians (see the module's docstring)."""
    comm = [[e for e in ev if e.get("cat") == "COMM"] for ev in ranks]
    queued = [{(e["name"], e["args"].get("step")): e for e in ev if e.get("cat") == "QUEUED"} for ev in ranks]
    issued = [{(e["name"], e["args"].get("step")): e for e in c} for c in comm]
    steps = sorted({e["args"]["step"] for e in comm[0]})
    measured = [k for k in steps[skip:-1] if all(any(e["args"]["step"] == k + 1 for e in c) for c in comm)]
    if not measured:
        raise ValueError(f"no step after the first {skip} with a next step on every rank: "
                         "run more steps, or --skip less")
    marks = sorted(e["ts"] for e in ranks[0] if e.get("cat") == "STEP")
    rows = []
    for k in measured:
        row: dict[str, Any] = {"step": k, "ranks": []}
        lands = [max(e["ts"] + e["dur"] for e in c if e["args"]["step"] == k) for c in comm]
        origin = lands[0]
        last = max((e for e in comm[0] if e["args"]["step"] == k), key=lambda e: e["ts"] + e["dur"])
        row["last_piece"] = {"name": last["name"], "bytes": last["args"].get("bytes", 0)}
        for r, events in enumerate(ranks):
            land = lands[r]
            nxt = [e for key, e in queued[r].items() if key[1] == k + 1]
            first = min(e["ts"] for e in nxt)
            sizes = {name: e["args"].get("bytes", 0) for (name, step), e in issued[r].items() if step == k + 1}
            big_ready = [e["ts"] for e in nxt if sizes.get(e["name"], 0) >= big]
            woke = [e["ts"] + e["dur"] for e in events
                    if e.get("cat") == "WAIT" and e["ts"] <= land <= e["ts"] + e["dur"] + 2e3]
            updates = sum(e["dur"] for e in events if e.get("cat") == "UPDATE" and land - 1e3 <= e["ts"] < first)
            row["ranks"].append({
                "landed_ms": (land - origin) / 1e3,
                "woke_ms": (woke[0] - origin) / 1e3 if woke else None,
                "update_ms": updates / 1e3,
                "first_ready_ms": (first - origin) / 1e3,
                "first_big_ready_ms": (min(big_ready) - origin) / 1e3 if big_ready else None,
            })
        window = [(a, b) for a, b in zip(marks, marks[1:], strict=False) if a <= origin < b]
        if window:
            a, b = window[0]
            busy = _union_ms([(max(e["ts"], a), min(e["ts"] + e["dur"], b)) for e in comm[0]
                              if e["ts"] + e["dur"] > a and e["ts"] < b])
            row["step_ms"] = (b - a) / 1e3
            row["in_flight_ms"] = busy
        rows.append(row)
    lag = []
    for key, e in issued[1].items() if len(ranks) > 1 else ():
        if key[1] is None or key[1] < steps[skip] or key not in issued[0] or key not in queued[1]:
            continue
        if queued[1][key]["ts"] < issued[0][key]["ts"] - 200:  # ready before rank 0 issued it
            lag.append((e["ts"] - issued[0][key]["ts"]) / 1e3)

    def med(get: Any) -> float | None:
        values = [v for v in (get(row) for row in rows) if v is not None]
        return statistics.median(values) if values else None

    summary = {
        "steps": len(rows),
        "step_ms": med(lambda r: r.get("step_ms")),
        "in_flight_ms": med(lambda r: r.get("in_flight_ms")),
        "idle_ms": med(lambda r: r["step_ms"] - r["in_flight_ms"] if "step_ms" in r else None),
        "per_rank": [{
            name: med(lambda row, r=r, name=name: row["ranks"][r][name])
            for name in ("landed_ms", "woke_ms", "update_ms", "first_ready_ms", "first_big_ready_ms")
        } for r in range(len(ranks))],
        "follower_lag_ms": ({"pieces": len(lag), "p50": statistics.median(lag), "p90": _pct(lag, 0.9)}
                            if lag else None),
    }
    return {"summary": summary, "steps": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="the bench's --timeline DIR")
    parser.add_argument("strategy", help="the trace's name without .rank<r>.json, e.g. dynamic_2MiB_8MiB")
    parser.add_argument("--skip", type=int, default=3, help="steps to leave out at the start (warm-up; default 3)")
    parser.add_argument("--big", type=int, default=1 << 20, help="bytes of a piece that fills the link (default 1 MiB)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    paths = []
    while os.path.exists(path := os.path.join(args.dir, f"{args.strategy}.rank{len(paths)}.json")):
        paths.append(path)
    if not paths:
        print(f"no {args.strategy}.rank0.json in {args.dir}: run commsched bench with --timeline {args.dir}",
              file=sys.stderr)
        return 2
    try:
        result = analyse([_events(p) for p in paths], args.skip, args.big)
    except ValueError as exc:
        print(f"step_boundary: {exc}", file=sys.stderr)
        return 2
    s = result["summary"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"{args.strategy}: {s['steps']} steps of {len(paths)} ranks; median step {fmt(s['step_ms'])} ms, "
          f"some piece in flight {fmt(s['in_flight_ms'])} ms, none {fmt(s['idle_ms'])} ms")
    print("step boundary, ms after rank 0's last piece of the step landed (medians):")
    for r, p in enumerate(s["per_rank"]):
        print(f"  rank {r}: landed {fmt(p['landed_ms'])}, forward woke {fmt(p['woke_ms'])}, updates "
              f"{fmt(p['update_ms'])}, first gradient ready {fmt(p['first_ready_ms'])}, first piece >= "
              f"{args.big} B ready {fmt(p['first_big_ready_ms'])}")
    lag = s["follower_lag_ms"]
    if lag:
        print(f"follower's issue after rank 0's, pieces it had ready first: p50 {lag['p50']:.2f} ms, "
              f"p90 {lag['p90']:.2f} ms ({lag['pieces']} pieces)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
