"""torch's own gradient reducer (DDP's C++ ``Reducer``) as an engine of :class:`DistributedOptimizer`.

Where communication is hidden already and the cores are busy, commsched's per-piece path (a Python hook
per gradient that submits a task, a dispatch thread, a completion callback, a Python ``step()`` that
waits) costs 2-8 % of a step that DDP does not pay: DDP's hooks, bucket copies and launches run in C++
(docs/tuning.md, "torch's reducer as a start"). No schedule can win there: the communication is off the
critical path. So the tuner of ``ordering="auto"`` may hand the gradients to the same C++ reducer DDP
uses, on commsched's own process group, and measure it like any other setting; it keeps whichever is
faster. Under it commsched schedules nothing: buckets of ``bucket_bytes`` in the order backward makes
them (after the first step, from the order it saw, as DDP rebuilds them), copied and launched in C++,
averaged by a small comm hook of ours (which turns a failed all-reduce into a :class:`CommschedError` at
``step()``), and copied back into ``p.grad`` when backward ends; ``step()`` runs the wrapped optimizer once.

Not a transport of our own: the collectives are the process group's all-reduces, launched by torch.

The reducer needs every parameter to get a gradient in every step (DDP's ``find_unused_parameters=False``
contract): one that does not leaves its bucket unreduced. :class:`DdpReducer` checks at ``step()`` that
the reducer finished, and raises (naming the fix) rather than let a local gradient be applied;
:func:`reducer_eligible` keeps the tuner from choosing it for a model where a recorded step left a
parameter without a gradient.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from commsched.errors import CommschedError

__all__ = ["DdpReducer", "reducer_eligible"]


def reducer_eligible(*, backend: str, op: str, predivide: float, passes: int, split: bool, has_model: bool,
                     every_param_every_step: bool, params: list[torch.Tensor]) -> Optional[str]:
    """Why torch's reducer cannot stand in for commsched on this optimizer, or None if it can.

    It averages over a torch.distributed group (not Horovod), divides by the world size only, reduces
    every backward (no ``backward_passes_per_step``), dense tensors of one device, and needs a forward
    (``model=``) to arm it and every parameter to get a gradient every step."""
    if backend != "torch":
        return "backend is not torch.distributed"
    if op != "average" or predivide != 1.0:
        return "op is not a plain average"
    if passes != 1:
        return "backward_passes_per_step > 1"
    if split:
        return "split_tied_embeddings exchanges rows of its own"
    if not has_model:
        return "no model: nothing arms the reducer before backward"
    if not every_param_every_step:
        return "a recorded step left a parameter without a gradient (DDP's find_unused_parameters case)"
    if any(p.is_sparse for p in params) or len({p.device for p in params}) != 1:
        return "sparse parameters, or parameters on more than one device"
    return None


class DdpReducer:
    """DDP's C++ ``Reducer`` over ``params`` on ``group``, with ``bucket_bytes`` buckets.

    :meth:`before_forward` (the model's root forward pre-hook, grad enabled and synchronizing) arms it for
    the backward to come, as DDP's forward does; :meth:`check_finished` (``step()``) raises if a backward
    left a bucket unreduced; :meth:`close` removes its autograd hooks. The first backward runs in buckets of
    the parameters in reverse registration order; the next forward rebuilds them in the order that backward
    made the gradients (one broadcast of rank 0's assignment, as DDP does), so every rank has the same buckets."""

    def __init__(self, params: list[torch.Tensor], group: "dist.ProcessGroup", bucket_bytes: int,
                 names: Optional[list[str]] = None) -> None:
        if not params:
            raise ValueError("DdpReducer needs at least one parameter")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive number of bytes (DDP: 25 MiB)")
        self.bucket_bytes = bucket_bytes
        # Buckets of ``bucket_bytes`` from the first backward on, in reverse registration order (the order
        # backward makes most models' gradients; the same on every rank), rebuilt after it from the order
        # that backward really made them (one broadcast of rank 0's, as DDP does). DDP without
        # find_unused_parameters starts with one bucket instead, which overlaps nothing in that backward: a
        # whole step's communication exposed once per start, harmless where DDP starts once, but auto's
        # tuner starts the reducer anew at each sample of it and at each switch back to it (docs/tuning.md,
        # "The first step after a switch to the reducer").
        indices, limits = dist._compute_bucket_assignment_by_size(params, [bucket_bytes], [False] * len(params))
        mapping = dict(enumerate(names)) if names is not None else {}
        self._reducer: Any = dist.Reducer(params, list(reversed(indices)), list(reversed(limits)), group,
                                          [False] * len(params), bucket_bytes, False, False, mapping,
                                          bucket_bytes)
        self.armed = 0  # backwards armed (forwards with grad enabled while synchronizing)
        # DDP's reduction as a comm hook of ours: each bucket summed, then scaled by 1 / world on the engine's
        # completion thread (DDP without a hook scales while copying into the bucket; the same values for a
        # world of a power of two). A failed all-reduce (a rank died or left) is kept and raised by step() as a
        # CommschedError before the wrapped optimizer runs: torch re-wraps any error raised in a hook as a
        # RuntimeError inside backward(), and gloo's own ("Connection reset by peer") says nothing of what
        # happened. Its price: two Python calls per bucket, 0.16-0.19 ms of the training thread's CPU a bucket
        # on this 2-core machine (0.9 ms a step on compute-heavy, 2.1 ms on gpt2, 1 MiB buckets: ~0.5 %).
        self._group, self._scale = group, 1.0 / group.size()
        self.failure: Optional[CommschedError] = None
        dist._register_comm_hook(self._reducer, None, self._hook)

    def _hook(self, _state: Any, bucket: Any) -> Any:
        return self._reduce(bucket)  # looked up per call: a test may watch the buckets

    def _reduce(self, bucket: Any) -> Any:
        """One bucket: all-reduced on the group, then scaled in place. A failed all-reduce hands back the bucket
        as it is (backward ends) and is kept in :attr:`failure`, which ``step()`` raises before any update."""
        buffer = bucket.buffer()

        def landed(future: Any) -> torch.Tensor:
            try:
                return future.value()[0].mul_(self._scale)
            except Exception as exc:  # noqa: BLE001 - whatever the engine raised, kept as commsched's
                if self.failure is None:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    self.failure = CommschedError(
                        "torch's reducer (the engine ordering='auto' or the plan chose) could not all-reduce a "
                        f"bucket of gradients: {first}. Another rank failed or left the job (see its log); no "
                        "update was applied for this step")
                    self.failure.__cause__ = exc
                return buffer

        return self._launch(buffer).then(landed)

    def _launch(self, buffer: torch.Tensor) -> Any:
        return self._group.allreduce([buffer]).get_future()

    def before_forward(self) -> None:
        """Arm the reducer for the next backward (the previous one's reduction must have finished)."""
        reducer = self._open()
        if self.failure is not None:  # a forward after a failed step: the job cannot go on
            raise self.failure
        try:
            reducer._rebuild_buckets()  # a no-op after the first rebuild; raises if a reduction is unfinished
        except RuntimeError as exc:
            raise CommschedError(_unfinished(exc)) from exc
        reducer.prepare_for_forward()
        reducer.prepare_for_backward([])
        self.armed += 1

    def check_finished(self) -> None:
        """``step()``: the last armed backward's buckets are all reduced and back in ``p.grad`` (else the
        failed all-reduce, or the unfinished reduction, as a :class:`CommschedError`)."""
        if self.failure is not None:
            raise self.failure
        try:
            self._open()._check_reducer_finalized()
        except RuntimeError as exc:
            raise CommschedError(_unfinished(exc)) from exc

    def close(self) -> None:
        """Remove the reducer's autograd hooks (nothing is in flight at a step boundary). Idempotent."""
        reducer, self._reducer = self._reducer, None
        if reducer is not None:
            reducer._remove_autograd_hooks()

    def _open(self) -> Any:
        if self._reducer is None:
            raise CommschedError("torch's reducer under this DistributedOptimizer is closed")
        return self._reducer


def _unfinished(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ("torch's reducer (the engine ordering='auto' chose for this run) did not finish reducing the last "
            f"backward's gradients: a parameter got no gradient in that step ({first}). Use "
            "ordering='dynamic' (or 'fifo') for a model whose steps leave parameters unused")
