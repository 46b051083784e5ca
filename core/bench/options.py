"""Flags and helpers shared by the per-framework benchmarks (TensorFlow, MXNet).

The PyTorch benchmark has its own richer CLI (workloads); the other frameworks
benchmark an MLP on the same emulated cluster and take the same flags.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

__all__ = ["add_mlp_bench_arguments", "horovod_gloo_env", "parse_strategy_list"]


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
    parser.add_argument("--partition-mb", type=float, default=partition_mb,
                        help=f"commsched piece size in MiB (default {partition_mb:g}{partition_note})")
    parser.add_argument("--credit-mb", type=float, default=credit_mb,
                        help=f"commsched bytes in flight in MiB (default {credit_mb:g})")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per strategy (default 600)")
    parser.add_argument("--json", required=True, metavar="PATH", help="write the report here")


def parse_strategy_list(text: str, allowed: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(strategies, unknown)`` from a comma-separated list."""
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    return chosen, sorted(set(chosen) - set(allowed))


def horovod_gloo_env(master_addr: str, port: int | str, ifname: str, slot: Any) -> dict[str, str]:
    """Environment for ``hvd.init()`` with gloo, from a ``horovod.runner`` slot (rank, sizes, hostname),
    so a benchmark can start Horovod itself inside its namespaces instead of through horovodrun."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": master_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": ifname,
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }
