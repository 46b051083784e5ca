"""Flags and helpers shared by the MLP benchmarks (TensorFlow, MXNet).

The PyTorch benchmark has its own richer CLI (workloads); the other frameworks
benchmark an MLP on the same emulated cluster and take the same flags.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

__all__ = ["CLASSES", "INPUTS", "add_mlp_bench_arguments", "mebibytes", "mlp_param_count", "mlp_workload",
           "parse_strategy_list"]


def mebibytes(text: str) -> float:
    """argparse type of ``--partition-mb``/``--credit-mb``: a size in MiB of at least one byte.

    A size that rounds to 0 bytes (``1e-9``) would pass a ``> 0`` check and then fail
    inside every worker; it is refused here, as an argparse error naming the fix.
    """
    try:
        mb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MiB; give e.g. 1 or 0.25") from None
    if not 1 <= mb * (1 << 20) < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text} MiB is less than one byte (or not finite); give at least {1 / (1 << 20):.3g} MiB, e.g. 1")
    return mb


def add_mlp_bench_arguments(parser: argparse.ArgumentParser, *, strategies: Sequence[str], default_strategies: str,
                            layers: int, gradient_mb_hint: str, partition_mb: float, credit_mb: float,
                            partition_note: str = "") -> None:
    """The flags every MLP benchmark takes; defaults differ per framework."""
    parser.add_argument("--workers", type=int, default=2, help="worker machines (default 2)")
    parser.add_argument("--bandwidth", default="1gbit", help="rate of every link, each direction (default 1gbit)")
    parser.add_argument("--network", choices=("netns", "loopback"), default="netns",
                        help="netns: shaped namespaces (needs root; falls back to loopback); loopback: unshaped")
    parser.add_argument("--strategies", default=default_strategies,
                        help=f"comma-separated, from {', '.join(strategies)} (default {default_strategies})")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    parser.add_argument("--layers", type=int, default=layers,
                        help=f"hidden layers (default {layers}: {gradient_mb_hint} of gradients)")
    parser.add_argument("--batch-size", type=int, default=128, help="samples per worker per step (default 128)")
    parser.add_argument("--steps", type=int, default=15, help="measured steps (default 15)")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured steps first (default 4)")
    parser.add_argument("--partition-mb", type=mebibytes, default=partition_mb,
                        help=f"commsched piece size in MiB (default {partition_mb:g}{partition_note})")
    parser.add_argument("--credit-mb", type=mebibytes, default=credit_mb,
                        help=f"commsched bytes in flight in MiB (default {credit_mb:g})")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per strategy (default 600)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every strategy this many times, each round in another order (a Williams design), "
                             "and report the median of the rounds and the speedups paired within each round "
                             "(default 1; python -m commsched.bench.paired compares any two: docs/bench.md, Rounds)")
    parser.add_argument("--json", required=True, metavar="PATH", help="write the report here")


def parse_strategy_list(text: str, allowed: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(strategies, unknown)`` from a comma-separated list."""
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    return chosen, sorted(set(chosen) - set(allowed))


#: The MLP benchmarks' model: ``INPUTS`` features to ``CLASSES`` logits.
INPUTS = 256
CLASSES = 10


def mlp_param_count(hidden: int, layers: int) -> int:
    """Parameters of the benchmarks' MLP: ``layers`` dense layers of width ``hidden``
    after ``INPUTS`` features, then a dense layer to ``CLASSES`` logits (weights and biases)."""
    return INPUTS * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden * CLASSES + CLASSES


def mlp_workload(hidden: int, layers: int) -> dict[str, Any]:
    """The report's ``workload`` block for the MLP (float32 parameters)."""
    params = mlp_param_count(hidden, layers)
    return {"name": "mlp", "description": f"MLP {INPUTS}-{layers}x{hidden}-{CLASSES}, float32",
            "param_bytes": params * 4, "num_params": params, "layers": None}
