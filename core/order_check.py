"""After each step, the ranks check that they reduced the same tensors in the same order.

An engine that pairs collectives by their position (gloo and NCCL under torch.distributed) sums
whatever each rank issues n-th. Under ``ordering="dynamic"``/``"static"``/``"planned"`` the ranks
agree on that order (:mod:`commsched.policy`), but under ``"fifo"`` each rank issues in its own
submission order: if one rank took another branch (a layer skipped, two same-shaped layers used in
another order), same-sized pieces of different tensors are summed together, silently. So, with
``SchedulerConfig(verify_order=True)``, each rank folds the names and sizes of what it submitted in a
step, in order, into a 52-bit digest, and at the end of the step reduces one extra three-element
float64 tensor (the digest's two 26-bit halves and the count) behind the step's pieces. Every
rank that saw the same step finds the sum equal to ``world_size`` times its own values; a rank that
finds otherwise raises :class:`~commsched.errors.OrderAgreementError` (which the scheduler tells the
other ranks), naming the first tensor where it differs from rank 0's when the rendezvous store can
carry the lists.

What it catches: the same count of same-sized tensors in another order or under other names. A
different count shifts every later piece, so some piece pairs tensors of different sizes before the
check: gloo then aborts the process itself ("Received data size doesn't match expected size", measured
with torch 2.13), and only an ordering that agrees before it issues (``dynamic``) avoids that. The sum is
exact: each half is below 2**26, so the sum of ``world_size`` of them stays below 2**53 for up to 2**27
ranks. Framework-free: the plugin makes the tensor and reads its values.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

from commsched.errors import OrderAgreementError

__all__ = ["CHECK_PREFIX", "StepManifest", "agree", "describe_difference", "digest_values", "is_check_name", "mismatch",
           "split_lists"]

#: Names of the check's tasks: ``commsched/order-check/<step>`` (unique among unfinished tasks).
CHECK_PREFIX = "commsched/order-check/"

_HALF = 26  # bits per half of the 52-bit digest


class StepManifest:
    """What this rank submitted in the current step, in submission order (``name:numel:dtype``)."""

    def __init__(self) -> None:
        self.entries: list[str] = []

    def add(self, name: str, numel: int, dtype: str) -> None:
        self.entries.append(f"{name}:{numel}:{dtype}")

    def take(self) -> list[str]:
        """This step's entries; the manifest starts empty for the next step."""
        entries, self.entries = self.entries, []
        return entries


def is_check_name(name: str) -> bool:
    return name.startswith(CHECK_PREFIX)


def digest_values(entries: Sequence[str]) -> tuple[float, float, float]:
    """The three values a rank reduces for ``entries``: two 26-bit halves of a hash and the count."""
    h = int.from_bytes(hashlib.blake2b("\n".join(entries).encode(), digest_size=7).digest(), "big")
    h &= (1 << 2 * _HALF) - 1
    return float(h >> _HALF), float(h & ((1 << _HALF) - 1)), float(len(entries))


def agree(reduced: Sequence[float], own: Sequence[float], world_size: int) -> bool:
    """Whether the reduced sum is what ``world_size`` ranks with this rank's values would give."""
    return len(reduced) == len(own) and all(r == world_size * v for r, v in zip(reduced, own, strict=True))


def describe_difference(step: int, rank: int, mine: Sequence[str], other_rank: int,
                        theirs: Optional[Sequence[str]]) -> str:
    """The message of the error: the first position where ``mine`` and ``theirs`` differ."""
    head = (f"with ordering='fifo' the ranks reduced different tensors in step {step}: the engine pairs "
            "collectives by position, so same-sized pieces of different tensors were summed together")
    fix = ("every rank must submit the same gradients in the same order each step; use ordering='dynamic', "
           "which agrees on the order and names a missing tensor before anything is summed")
    if theirs is None:
        return (f"{head} (rank {rank} submitted {len(mine)} tensors; rank {other_rank}'s list did not arrive "
                f"to name the first difference); {fix}")
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return (f"{head}: the {_ordinal(i + 1)} tensor was {_entry(a)} on rank {rank} and {_entry(b)} on "
                    f"rank {other_rank}; {fix}")
    if len(mine) != len(theirs):
        longer, n = (rank, mine) if len(mine) > len(theirs) else (other_rank, theirs)
        return (f"{head}: rank {rank} submitted {len(mine)} tensors, rank {other_rank} {len(theirs)}; the first "
                f"one only rank {longer} had was {_entry(n[min(len(mine), len(theirs))])}; {fix}")
    return f"{head} (the lists of rank {rank} and rank {other_rank} are equal: another rank differs); {fix}"


def mismatch(step: int, rank: int, mine: Sequence[str], other_rank: int,
             theirs: Optional[Sequence[str]]) -> OrderAgreementError:
    return OrderAgreementError(describe_difference(step, rank, mine, other_rank, theirs))


def _entry(entry: str) -> str:
    name, numel, dtype = entry.rsplit(":", 2)
    return f"{name!r} ({numel} elements of {dtype})"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def split_lists(raw: Any) -> list[str]:
    """A list another rank wrote to the store (newline-joined entries)."""
    text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    return text.split("\n") if text else []
