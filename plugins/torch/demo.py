"""``make demo`` / ``commsched demo``: the quick benchmark.

Two workers on an emulated 1 Gbit/s cluster (network namespaces and ``tc``; plain
loopback when not root), the ``balanced`` workload, PyTorch DDP against commsched
``dynamic``; prints the table and writes ``out/demo.json`` and ``out/demo.png``.
"""

from __future__ import annotations

import argparse

from commsched.bench import cli as bench_cli

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags (a subset of ``commsched bench``'s) to ``parser``."""
    parser.description = ("The quick benchmark: commsched bench --workload balanced --workers 2 "
                          "--bandwidth 1gbit, DDP against commsched dynamic; writes demo.json and demo.png.")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per strategy (default 12)")
    parser.add_argument("--strategies", default="ddp,dynamic", help="default: ddp,dynamic")
    parser.add_argument("--out", default="out", help="folder for demo.json and demo.png (default out/)")
    parser.add_argument("--network", choices=("netns", "loopback"), default="netns")


def run(args: argparse.Namespace) -> int:
    """Run the quick benchmark; the exit status of ``commsched bench``."""
    bench_args = [
        "--workload", "balanced", "--workers", "2", "--bandwidth", "1gbit",
        "--strategies", args.strategies, "--steps", str(args.steps), "--warmup", "3",
        "--json", f"{args.out}/demo.json", "--plot", f"{args.out}/demo.png", "--network", args.network,
    ]
    parser = argparse.ArgumentParser(prog="commsched bench")
    bench_cli.add_arguments(parser)
    print("commsched demo = commsched bench " + " ".join(bench_args), flush=True)
    return bench_cli.run(parser.parse_args(bench_args))


if __name__ == "__main__":
    top = argparse.ArgumentParser(prog="commsched demo")
    add_arguments(top)
    raise SystemExit(run(top.parse_args()))
