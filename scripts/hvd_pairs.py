"""commsched against ``hvd.DistributedOptimizer`` in Horovod's synthetic-benchmark shape, as interleaved pairs.

    .venv/bin/python scripts/hvd_pairs.py --pairs 12 --json out/hvd_pairs.json

Runs ``examples/horovod_synthetic_benchmark.py`` under ``horovodrun -np 2 --gloo`` once with
``--dist hvd`` and once with ``--dist commsched`` per pair, in ABBA order (odd pairs hvd first,
even pairs commsched first) so that a drift of the shared machine's load falls on both alike.
Prints and writes every run's img/s (rank 0's mean over the script's ``timeit`` iterations), the
medians, their ratio, the median of the per-pair ratios and how many pairs commsched won. A
benchmark, not a test: read the ratio against the spread of the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "horovod_synthetic_benchmark.py")


def run_one(dist: str, args: argparse.Namespace, workdir: str, tag: str) -> float:
    out = os.path.join(workdir, f"{dist}-{tag}.json")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo", sys.executable, SCRIPT,
           "--dist", dist, "--num-batches-per-iter", str(args.num_batches_per_iter),
           "--num-iters", str(args.num_iters), "--json", out]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{dist} run {tag} took more than --timeout-s {args.timeout_s:g} s; is horovodrun working "
                         f"(try: {' '.join(cmd)})?") from None
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise SystemExit(f"{dist} run {tag} failed (rc {proc.returncode}): {' '.join(cmd)}\n{tail}")
    with open(out) as f:
        return float(json.load(f)["img_sec_per_worker"])


def summary(pairs: list[dict[str, float]]) -> dict[str, float]:
    hvd = [p["hvd"] for p in pairs]
    ours = [p["commsched"] for p in pairs]
    ratios = [p["commsched"] / p["hvd"] for p in pairs]
    return {"pairs": len(pairs), "hvd_median": statistics.median(hvd), "commsched_median": statistics.median(ours),
            "ratio_of_medians": statistics.median(ours) / statistics.median(hvd),
            "median_pair_ratio": statistics.median(ratios), "min_pair_ratio": min(ratios),
            "max_pair_ratio": max(ratios), "commsched_won": sum(r >= 1.0 for r in ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=20)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="the most one horovodrun may take")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    pairs = []
    with tempfile.TemporaryDirectory(prefix="commsched-hvd-pairs-") as workdir:
        for i in range(1, args.pairs + 1):
            order = ("hvd", "commsched") if i % 2 else ("commsched", "hvd")
            pair: dict[str, float] = {}
            for dist in order:
                pair[dist] = run_one(dist, args, workdir, str(i))
            pair["load"] = os.getloadavg()[0]
            pairs.append(pair)
            print(f"pair {i}: hvd {pair['hvd']:.1f} img/s, commsched {pair['commsched']:.1f} img/s "
                  f"({pair['commsched'] / pair['hvd']:.3f}x), load {pair['load']:.2f}", flush=True)
    result = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]), "when": time.time(),
              "runs": pairs, "summary": summary(pairs)}
    s = result["summary"]
    print(f"{s['pairs']} pairs: hvd median {s['hvd_median']:.1f}, commsched median {s['commsched_median']:.1f} img/s; "
          f"ratio of medians {s['ratio_of_medians']:.3f}x, median pair ratio {s['median_pair_ratio']:.3f}x "
          f"({s['min_pair_ratio']:.3f}-{s['max_pair_ratio']:.3f}), commsched won {s['commsched_won']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
