"""Tied embeddings: the output projection's part of the gradient early, the lookup's part as rows.

A GPT-style model uses its token embedding twice: the input lookup (first in the forward) and
the output projection (last). Autograd sums both parts before the weight's gradient hook
fires, and the lookup's part comes last in backward, so the whole (vocab x dim) gradient is
ready only when backward ends while the next forward needs it first: it is exposed whatever the
order (docs/bench.md, "Where the time goes": gpt2's ~0.2-0.3 s a step at 1 Gbit/s).

:class:`TiedSplit` (``DistributedOptimizer(split_tied_embeddings=True)``) separates the two:

- the lookup runs on the detached weight, so autograd's sum for the weight holds the
  projection's part only; its hook fires as soon as the projection's backward made it (first in
  backward) and the scheduler reduces it, dense, during the rest of backward;
- the lookup's part is a handful of rows (one per distinct token of the batch, where the dense
  form is vocab x dim of mostly zeros). The lookup's own backward (a custom autograd function)
  takes its output's gradient; each rank sums its rows per token id, and a thread of this module
  all-gathers every rank's ids and rows: on torch.distributed on a process group of its own, so it
  never interleaves with the scheduler's collectives (``backends.all_gather_rows``); on Horovod by
  its allgather under names of their own, which Horovod matches by name
  (``HorovodBackend.all_gather_rows``);
- before the update (cross-iteration: the embedding's forward pre-hook; synchronous: ``step()``)
  the gathered rows are added to the averaged dense part: ``grad += index_add(rows) / world``.

The sum is the same mathematically, not bit for bit (the rows are summed in another order than
one dense all-reduce would), so training with the split is allclose to the reference, not
bitwise. Each rank receives every rank's rows: with N ranks and T distinct tokens per rank that
is N·T·dim elements against the 2·vocab·dim a ring all-reduce moves per rank, so the split pays
while N·T < 2·vocab (GPT-2's 50 257 tokens: up to ~100 ranks at 1 024 tokens per rank).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from commsched.errors import CommschedError, CommschedTimeout

__all__ = ["TiedSplit", "find_tied_embeddings"]

def find_tied_embeddings(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """The ``nn.Embedding`` modules of ``model`` whose weight is registered under another name too
    (``lm_head.weight = wte.weight``): ``(module name, module)``. ``ValueError`` naming the module for
    an embedding the split cannot take (``max_norm``, ``scale_grad_by_freq``, ``sparse``)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    found = []
    for mod_name, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or len(names.get(id(module.weight), ())) < 2:
            continue
        bad = [what for what, on in (("max_norm", module.max_norm is not None),
                                     ("scale_grad_by_freq", module.scale_grad_by_freq),
                                     ("sparse", module.sparse)) if on]
        if bad:
            raise ValueError(f"split_tied_embeddings: the tied embedding {mod_name or 'model'!r} uses "
                             f"{', '.join(bad)}, whose gradient the split cannot form from rows; drop those options "
                             "or split_tied_embeddings=True")
        found.append((mod_name, module))
    return found


class _Lookup(torch.autograd.Function):
    """The embedding lookup on the detached weight (a fresh tensor, so in-place use of the output is
    fine); its backward hands the output's gradient to the split instead of to the weight."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                split: "TiedSplit") -> torch.Tensor:
        ctx.split, ctx.ids = split, ids
        return F.embedding(ids, weight, split.module.padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.split.rows_ready(ctx.ids, grad)
        return None, None, None, None


def _summed(ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` summed per distinct id: (the distinct ids, sorted; one row each)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(unique.numel(), rows.shape[1], dtype=rows.dtype, device=rows.device)
    summed.index_add_(0, inverse, rows)
    return unique, summed


class _Exchange:
    """One step's rows on their way to every rank: ``result`` (ids, rows) or ``error`` once ``event``."""

    __slots__ = ("event", "result", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.error: Optional[BaseException] = None


class TiedSplit:
    """The split of one tied ``nn.Embedding`` (module docstring). Every rank makes one per tied
    embedding, in the same order, with the same ``gather``."""

    def __init__(self, name: str, module: nn.Embedding, *, gather: Optional[Callable[..., tuple]], scale: float,
                 timeout_s: float) -> None:
        self.name, self.module = name, module
        # every rank's (ids, rows) from this rank's, in rank order (the engine's all_gather_rows, see
        # backends.py); None: one rank
        self._gather = gather
        self.scale, self.timeout_s = scale, timeout_s
        # lets the lookup's output require grad without the weight (its own gradient is always None)
        self._anchor = torch.zeros((), requires_grad=True)
        self._parts: list[_Exchange] = []  # this step's exchanges (one a step, see flush)
        # rows of backward passes not exchanged yet (gradient accumulation, no_sync), and whether the
        # step's synchronizing pass has begun (arm): its lookup's rows then go at once
        self._local: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._armed = False
        self._lock = threading.Lock()
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self.exchanges = 0
        self.rows = 0
        self._thread = threading.Thread(target=self._run, name=f"commsched-tied-{name}", daemon=True)
        self._thread.start()
        module.forward = self._forward  # an instance attribute: the module's class, hooks and state_dict stay

    # ------------------------------------------------------------ forward and backward (user's threads)
    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.module
        if torch.is_grad_enabled() and m.weight.requires_grad:
            return _Lookup.apply(self._anchor, m.weight.detach(), ids, self)
        return F.embedding(ids, m.weight, m.padding_idx)

    def rows_ready(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Autograd's thread: this rank's rows, summed per token id, kept until the step's synchronizing
        pass (:meth:`arm`), then handed to the exchange thread (:meth:`flush`)."""
        ids = ids.reshape(-1)
        rows = grad.reshape(ids.numel(), -1)
        if self.module.padding_idx is not None:  # the padding row gets no gradient, as in nn.Embedding
            keep = ids != self.module.padding_idx
            ids, rows = ids[keep], rows[keep]
        with self._lock:
            self._local.append(_summed(ids, rows))
            armed, self._armed = self._armed, False
        if armed:
            self.flush()

    def arm(self) -> None:
        """The optimizer submitted the dense part of this step (the pass that synchronizes: the last of
        ``backward_passes_per_step``, outside ``no_sync``): this backward's rows, with every earlier
        pass's, are exchanged as soon as the lookup's backward made them."""
        with self._lock:
            self._armed = True

    def flush(self) -> None:
        """Hand the rows kept since the last exchange, summed per token id, to the exchange thread: one
        exchange a step however many backward passes it accumulated. Every rank calls it at the same point
        of the step (the synchronizing pass's lookup, else ``step()`` or the update)."""
        with self._lock:
            local, self._local = self._local, []
            self._armed = False
        if not local:
            return
        if len(local) == 1:
            ids, rows = local[0]
        else:
            ids, rows = _summed(torch.cat([i for i, _ in local]), torch.cat([r for _, r in local]))
        exchange = _Exchange()
        self._parts.append(exchange)
        self._queue.put((ids, rows, exchange))

    # ------------------------------------------------------------------------ the exchange thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ids, rows, exchange = item
            try:
                exchange.result = self._all_gather(ids, rows)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting update
                exchange.error = exc
            exchange.event.set()

    def _all_gather(self, ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        all_ids, all_rows = (ids, rows) if self._gather is None else self._gather(ids, rows)
        self.exchanges += 1
        self.rows += all_ids.numel()
        return all_ids, all_rows

    # ------------------------------------------------------------------------------ the update
    def pending(self) -> bool:
        return bool(self._parts or self._local)

    def done(self) -> bool:
        return not self._local and all(p.event.is_set() for p in self._parts)

    def add_into(self, grad: torch.Tensor) -> None:
        """Add every exchanged part of this step to ``grad`` (the averaged dense part), waiting for each
        at most ``timeout_s``; a failed or late exchange raises naming the embedding."""
        self.flush()  # rows of a step whose synchronizing pass did not reach the lookup
        parts, self._parts = self._parts, []
        for part in parts:
            if not part.event.wait(self.timeout_s):
                raise CommschedTimeout(f"the exchange of tied embedding {self.name!r}'s rows (a rank that stopped, "
                                       "or ran fewer backward passes, never joins it)", self.timeout_s, [self.name])
            if part.error is not None:
                raise CommschedError(f"exchanging the rows of tied embedding {self.name!r} failed: "
                                     f"{part.error!r}") from part.error
            ids, rows = part.result
            with torch.no_grad():
                grad.index_add_(0, ids, rows.to(grad.dtype), alpha=self.scale)

    def close(self) -> None:
        """Give the module its own forward back and end the thread (pending rows are dropped: close
        runs after the last update)."""
        if self.module.__dict__.get("forward") == self._forward:
            del self.module.forward
        self._queue.put(None)
        self._thread.join(timeout=5.0)

    def stats(self) -> dict[str, Any]:
        return {"exchanges": self.exchanges, "rows": self.rows}
