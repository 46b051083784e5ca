"""The dependency bound: what no schedule of whole gradients can beat, from the per-layer step.

``max(compute, comm)`` treats a step as two resources and forgets which gradient the next
forward needs when. Backward makes the first layer's gradients last, and the next forward needs
them first: their all-reduce starts when backward ends and the next forward waits for it, under
any order, any piece size and any credit. The bound here adds that dependency.

The model (one rank of synchronous data parallelism; all ranks alike):

- a step starts with the forward: layer ``j`` applies its update (``apply_s[j]``, the
  cross-iteration path's per-layer optimizer step; DDP's one ``step()`` is the sum) and runs its
  forward (``forward_s[j]``); backward starts when the forward ends and takes ``backward_s``;
  layer ``k``'s gradients are ready ``ready_s[k]`` after backward starts;
- one link carries the all-reduces; layer ``k``'s takes ``comm_s[k]`` of it;
- the next step's forward of layer ``k`` needs layers ``0..k`` reduced, and after it the rest of
  that step (the later layers' updates and forwards, then backward) runs on the same thread.

Layers ``0..k`` become ready no earlier than ``ready_s[k]`` (backward makes them after layer
``k``, in reverse order), so the link needs ``sum(comm_s[l] for l <= k)`` after that. Counted from
one backward's start to the next one's, the step ``P`` is at least

    ready_s[k] + sum(comm_s[l] for l <= k) + sum(forward_s[j] for j >= k) + sum(apply_s[j] for j > k)

for every layer ``k``, besides ``P >= compute`` and ``P >= sum(comm_s)``. (Layer ``k``'s own update is
left out: applied piece by piece as its pieces land, it overlaps its own all-reduce.) For ``k = 0``
this is the whole compute but layer 0's update, plus the first layer's all-reduce. It is a lower
bound when every layer's gradient is ready at once at ``ready_s`` (a layer here is a module: a
coarse one hides which of its parameters is ready first, and the bound it gives is an estimate)
and the step cannot change the dependency or the link's time: PyTorch's
``split_tied_embeddings=True`` does (it reduces most of a tied embedding's gradient early), and so
do compression and, on several nodes of several ranks, the two-level algorithm (fewer bytes across
nodes than the flat all-reduce ``comm_s`` is measured with). It takes compute as measured alone:
where a concurrent all-reduce slows compute (shared CPUs), the bench's ``contended_bound_s`` holds
that, and ``combined_bound_s`` is the larger of the two. See docs/bench.md, "The dependency bound".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DependencyBound", "dependency_bound", "bound_by_bytes"]


@dataclass(frozen=True)
class DependencyBound:
    """``step_s``: the bound; ``layer``: the index of the layer whose dependency sets it (``None``:
    the compute or the link alone does); ``compute_s``, ``comm_s``: the two resource bounds it
    takes the maximum with."""

    step_s: float
    layer: int | None
    compute_s: float
    comm_s: float


def _times(name: str, values: Sequence[float | None], n: int, *, optional: bool = False) -> list[float | None]:
    out = list(values)
    if len(out) != n:
        raise ValueError(f"dependency_bound: {name} has {len(out)} entries for {n} layers; give one per layer "
                         "in forward order")
    for i, v in enumerate(out):
        if v is None and optional:
            continue
        if v is None or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
            raise ValueError(f"dependency_bound: {name}[{i}] = {v!r} must be a time in seconds, >= 0")
    return out


def dependency_bound(forward_s: Sequence[float], ready_s: Sequence[float | None], comm_s: Sequence[float],
                     backward_s: float, apply_s: Sequence[float] | None = None) -> DependencyBound:
    """The bound of the module docstring for layers in forward order. ``ready_s[k]`` ``None``: layer
    ``k`` has no gradient (it only adds its forward). ``apply_s`` default: no per-layer update."""
    n = len(forward_s)
    fwd = _times("forward_s", forward_s, n)
    ready = _times("ready_s", ready_s, n, optional=True)
    comm = _times("comm_s", comm_s, n)
    apply = _times("apply_s", [0.0] * n if apply_s is None else apply_s, n)
    if not (isinstance(backward_s, (int, float)) and backward_s >= 0):
        raise ValueError(f"dependency_bound: backward_s = {backward_s!r} must be a time in seconds, >= 0")
    compute = sum(fwd) + sum(apply) + backward_s  # type: ignore[arg-type]
    total_comm = sum(comm)  # type: ignore[arg-type]
    best, layer = max(compute, total_comm), None
    carried, rest = 0.0, sum(fwd) + sum(apply)  # type: ignore[arg-type]
    for k in range(n):
        carried += comm[k]  # type: ignore[operator]
        rest -= apply[k]  # type: ignore[operator]
        if ready[k] is not None and comm[k]:
            bound = ready[k] + carried + rest  # type: ignore[operator]
            if bound > best:
                best, layer = bound, k
        rest -= fwd[k]  # type: ignore[operator]
    return DependencyBound(step_s=best, layer=layer, compute_s=compute, comm_s=total_comm)


def bound_by_bytes(forward_s: Sequence[float], ready_s: Sequence[float | None], nbytes: Sequence[int], *,
                   backward_s: float, comm_s: float, apply_s: Sequence[float] | None = None,
                   optimizer_s: float = 0.0) -> DependencyBound | None:
    """:func:`dependency_bound` where one all-reduce of every gradient took ``comm_s``: layer ``k``'s
    share is ``comm_s * nbytes[k] / sum(nbytes)`` (the latency of many small all-reduces left out,
    so the bound stays one). The update per layer is ``apply_s`` or else ``optimizer_s`` split by
    bytes. ``None`` when no layer has gradient bytes."""
    total = sum(nbytes)
    if total <= 0:
        return None
    apply = list(apply_s) if apply_s is not None else [optimizer_s * b / total for b in nbytes]
    return dependency_bound(forward_s, ready_s, [comm_s * b / total for b in nbytes], backward_s, apply)
