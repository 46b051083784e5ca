"""``DistributedOptimizer``: the user's torch optimizer, with scheduled gradient communication.

How a step flows (``cross_iteration=True``, the default):

1. backward: a post-accumulate-grad hook on each parameter takes its gradient
   (``p.grad`` becomes None: the scheduler owns it now) and submits it with the
   parameter's priority: the order of first use in the forward pass.
2. the scheduler reduces the pieces (sum over ranks) in priority order within the
   credit window, on the order every rank agreed on; the completion thread divides
   by the world size (sum, then divide, as DDP does).
3. ``step()`` returns at once.
4. next forward: a pre-hook on each module waits for that module's own parameters
   only, then applies the user's optimizer to exactly those parameters, on the
   user's thread. The time it waited is the step's *bubble*.

Per-parameter updates reuse the user's optimizer class: one instance per parameter,
built from the parameter's group hyperparameters (refreshed before every update, so
LR schedulers work) and sharing the wrapped optimizer's ``state``, so
``state_dict()`` has the wrapped optimizer's format. Nothing is re-implemented.

``cross_iteration=False`` is the synchronous path: reductions still overlap with
backward, gradients land back in ``p.grad`` (averaged), ``synchronize()`` waits
for them (then clip, inspect...), and ``step()`` runs the wrapped optimizer's own
``step()`` once for all parameters.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from commsched.config import SchedulerConfig, read_environment
from commsched.errors import CommschedError, SchedulerClosed
from commsched.lifecycle import Closeable
from commsched.policy import agrees_on_order
from commsched.scheduler import Scheduler, Task
from commsched.timeline import now_us
from commsched.plugins.torch.backends import default_store, make_backend
from commsched.plugins.torch.tensor_ops import TorchOps, check_gradient

__all__ = ["DistributedOptimizer"]

log = logging.getLogger(__name__)

_instances = itertools.count()
_NEEDS_ALL_GRADIENTS = (torch.optim.LBFGS,)
_BUBBLE_HISTORY = 1000


# Horovod fuses pieces that are ready in the same cycle; measured on 2 ranks
# (docs/horovod.md), 1 MiB pieces with a 16 MiB credit did best with fusion on.
HOROVOD_PARTITION_BYTES = 1 << 20


def _default_config(backend: str) -> SchedulerConfig:
    """The config when none is given: the core's defaults (and ``COMMSCHED_*``), except a
    smaller piece size on Horovod unless ``COMMSCHED_PARTITION_BYTES`` says otherwise."""
    if backend == "horovod" and "partition_bytes" not in read_environment():
        return SchedulerConfig(partition_bytes=HOROVOD_PARTITION_BYTES)
    return SchedulerConfig()


class _ParamState:
    """Bookkeeping for one parameter."""

    __slots__ = ("name", "param", "group", "priority", "sub", "future", "grad", "copy_back", "passes", "hyper")

    def __init__(self, name: str, param: torch.nn.Parameter, group: dict, priority: int) -> None:
        self.name = name
        self.param = param
        self.group = group
        self.priority = priority
        self.sub: Optional[torch.optim.Optimizer] = None
        self.future = None
        self.grad: Optional[torch.Tensor] = None
        self.copy_back: Optional[torch.Tensor] = None
        self.passes = 0
        self.hyper: Optional[dict] = None  # the group's hyperparameters when step() ended this gradient's step


class DistributedOptimizer(torch.optim.Optimizer, Closeable):
    """Wrap ``optimizer`` so that ``model``'s gradients are reduced by commsched.

    Args:
        optimizer: any ``torch.optim`` optimizer over ``model``'s parameters (SGD,
            Adam, AdamW, RMSprop, Adagrad, ...); its class and hyperparameters do
            the updates.
        model: the module whose forward uses the parameters (hooks go on it).
        config: a :class:`commsched.SchedulerConfig` (default: from ``COMMSCHED_*``).
        backend: ``"torch"`` (the default process group: gloo or NCCL) or ``"horovod"``
            (raises :class:`commsched.errors.HorovodUnavailable` without Horovod).
        broadcast: broadcast parameters, buffers and optimizer state from rank 0 now.
        backward_passes_per_step: reduce only every k-th backward (gradient accumulation).
        process_group: a torch.distributed group other than the default one.

    Guarantees: after ``synchronize()`` every parameter equals what plain synchronous
    training gives (all-reduce, divide by world size, ``optimizer.step()``) — bitwise
    on 2 ranks with a deterministic engine; every gradient is reduced once.
    :meth:`close` (or leaving a ``with`` block) applies what is pending and stops the
    threads; a closed optimizer raises :class:`commsched.SchedulerClosed` when used.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 config: SchedulerConfig | None = None, *, backend: str = "torch", broadcast: bool = True,
                 backward_passes_per_step: int = 1, process_group: Optional["dist.ProcessGroup"] = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer instance (e.g. "
                            "torch.optim.SGD(model.parameters(), "
                            f"lr=0.1)), got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once")
        if not isinstance(model, torch.nn.Module):
            raise TypeError("model must be the torch.nn.Module whose parameters the optimizer updates, "
                            f"got {type(model).__name__}")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1")
        self.config = config if config is not None else _default_config(backend)
        if isinstance(optimizer, _NEEDS_ALL_GRADIENTS):
            raise ValueError(
                f"{type(optimizer).__name__} needs a closure that re-evaluates the loss on all gradients at once, "
                "which per-parameter scheduled updates cannot provide; use it without commsched or reduce manually")
        self._initializing = True
        super().__init__([p for g in optimizer.param_groups for p in g["params"]], {})
        self._initializing = False
        # Share the wrapped optimizer's structures: LR schedulers, state_dict and the
        # user's own code all see one set of param_groups and one state.
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self.model = model
        self.backward_passes_per_step = backward_passes_per_step
        self._cross = self.config.cross_iteration

        self._backend = make_backend(backend, process_group, self.config.timeout_s)
        self.rank = self._backend.rank
        self.world_size = self._backend.world_size
        store = None
        if agrees_on_order(self.config, self.world_size, self._backend.negotiates_order):
            store = default_store()
        self._scheduler = Scheduler(self._backend, TorchOps(), self.config, store=store,
                                    key_prefix=f"commsched/opt{next(_instances)}")
        self.timeline = self._scheduler.timeline

        self._params = self._collect(model, optimizer)
        self._by_param = {id(s.param): s for s in self._params}
        self._hooks: list[Any] = []
        self._install_hooks()
        self._recording = True  # first forward: learn the order of first use
        self._seen: set[int] = set()
        self._next_priority = 0
        self._sync_enabled = True
        self._steps = 0
        self._bubble = 0.0
        self._bubbles: list[float] = []
        self._closed = False
        if broadcast and self.world_size > 1:
            self._broadcast_from_rank0()

    # --------------------------------------------------------------- set-up
    @staticmethod
    def _collect(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[_ParamState]:
        names = {id(p): n for n, p in model.named_parameters()}
        states, seen = [], set()
        order = {id(p): i for i, p in enumerate(model.parameters())}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        "the optimizer holds a parameter that is not in model.named_parameters() "
                        f"(shape {tuple(p.shape)}); pass the model whose parameters the optimizer updates")
                if id(p) in seen:
                    raise ValueError(f"parameter {names[id(p)]!r} appears twice in the optimizer's param_groups")
                seen.add(id(p))
                if p.requires_grad:
                    states.append(_ParamState(names[id(p)], p, group, order[id(p)]))
        if not states:
            raise ValueError("the optimizer has no parameter that requires a gradient")
        return states

    def _install_hooks(self) -> None:
        for state in self._params:
            self._hooks.append(state.param.register_post_accumulate_grad_hook(self._make_grad_hook(state)))
        owned: set[int] = set()
        for module in self.model.modules():
            mine = [self._by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in self._by_param]
            if mine:
                owned.update(id(s.param) for s in mine)
                self._hooks.append(module.register_forward_pre_hook(self._make_pre_hook(mine)))
        # The root waits for parameters whose module never runs its own forward.
        self._orphans: list[_ParamState] = []
        self._hooks.append(self.model.register_forward_pre_hook(self._root_pre_hook))

    def _broadcast_from_rank0(self) -> None:
        with torch.no_grad():
            for tensor in itertools.chain(self.model.parameters(), self.model.buffers()):
                self._backend.broadcast(tensor, 0)
        state = self._backend.broadcast_object(self.optimizer.state_dict() if self.rank == 0 else None, 0)
        if self.rank != 0 and state is not None and state.get("state"):
            self.optimizer.load_state_dict(state)

    # ----------------------------------------------------------------- hooks
    def _make_grad_hook(self, state: _ParamState) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._sync_enabled:
                return
            state.passes += 1
            if state.passes < self.backward_passes_per_step:
                return
            state.passes = 0
            self._submit(state)
        return hook

    def _submit(self, state: _ParamState) -> None:
        grad = state.param.grad
        if grad is None:
            return
        check_gradient(state.name, grad)
        if state.future is not None:
            raise CommschedError(
                f"parameter {state.name!r} got a new gradient before its previous one was applied; this happens "
                "when a parameter is used outside its module's forward. Call opt.synchronize() before that backward")
        if self._cross:
            state.param.grad = None  # the scheduler owns this gradient until the update
        buffer = grad if grad.is_contiguous() else grad.contiguous()
        state.copy_back = grad if buffer is not grad else None
        state.grad = buffer
        ready = None
        if buffer.is_cuda:  # readiness: the engine's stream waits for this point of the compute stream
            ready = torch.cuda.Event()
            ready.record()
        state.future = self._scheduler.submit(state.name, buffer, state.priority, on_done=self._after_reduce,
                                              ready=ready)

    def _after_reduce(self, task: Task) -> None:
        # Completion thread: average. The tensor is owned by us (cross-iteration) or
        # not read by the user before synchronize() (synchronous path).
        for work in task.handles:  # CUDA: order this stream after the engine's
            work.wait()
        task.tensor.div_(self.world_size)

    def _make_pre_hook(self, states: list[_ParamState]) -> Callable:
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            if self._recording:
                for s in states:
                    if id(s.param) not in self._seen:
                        s.priority = self._next_priority
                        self._next_priority += 1
                        self._seen.add(id(s.param))
            self._ready(states, "forward")
        return pre_hook

    def _root_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self._orphans:
            self._ready(self._orphans, "forward")

    def _ready(self, states: list[_ParamState], where: str) -> None:
        """Wait for ``states``' reductions and apply their updates (user's thread)."""
        pending = [s for s in states if s.future is not None]
        if not pending:
            return
        started = time.perf_counter()
        t0 = now_us()
        for s in pending:
            self._scheduler.wait(s.future)
        waited = time.perf_counter() - started
        self._bubble += waited
        if waited > 0 and self.timeline.enabled:
            self.timeline.span("WAIT", f"{where}: {pending[0].name}", t0, now_us())
        for s in pending:
            self._finish(s)

    def _finish(self, state: _ParamState) -> None:
        state.future = None
        grad, state.grad = state.grad, None
        if not self._cross:
            if state.copy_back is not None:
                state.copy_back.copy_(grad)
            state.copy_back = None
            return
        t0 = now_us()
        sub = state.sub
        if sub is None:
            sub = state.sub = type(self.optimizer)([dict(state.group)])
            sub.state = self.optimizer.state  # one state, the wrapped optimizer's
        group = sub.param_groups[0]
        hyper, state.hyper = state.hyper, None
        # The hyperparameters of the step this gradient belongs to (an LR scheduler
        # may have moved on since), else the group's current ones.
        for key, value in (hyper if hyper is not None else state.group).items():
            if key != "params":
                group[key] = value
        group["params"] = [state.param]
        param = state.param
        param.grad = grad
        try:
            sub.step()
        finally:
            param.grad = None
        if self.timeline.enabled:
            self.timeline.span("UPDATE", state.name, t0, now_us())

    # -------------------------------------------------------------- user API
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """End the step. Cross-iteration: returns at once (updates happen in the next
        forward or in :meth:`synchronize`). Synchronous: waits for the reductions and
        runs the wrapped optimizer's ``step(closure)``."""
        self._check_open()
        if self._cross and closure is not None:
            raise ValueError("step(closure) needs all gradients at once; create the DistributedOptimizer with "
                             "SchedulerConfig(cross_iteration=False) to use a closure")
        loss = None
        if self._recording:
            self._finish_recording()
        self._scheduler.mark_step()
        if not self._cross:
            self._ready(self._params, "step")  # waits (counted as bubble) and lands averaged grads in p.grad
            loss = self.optimizer.step(closure)
        else:
            snapshots = {id(g): {k: v for k, v in g.items() if k != "params"} for g in self.param_groups}
            for s in self._params:
                if s.future is not None and s.hyper is None:
                    s.hyper = snapshots[id(s.group)]
        self._steps += 1
        self._bubbles.append(self._bubble)
        if len(self._bubbles) > _BUBBLE_HISTORY:
            del self._bubbles[: len(self._bubbles) - _BUBBLE_HISTORY]
        self._bubble = 0.0
        return loss

    def _finish_recording(self) -> None:
        self._recording = False
        seen = self._seen
        unseen = [s for s in self._params if id(s.param) not in seen]
        for s in sorted(unseen, key=lambda s: s.priority):
            s.priority = self._next_priority
            self._next_priority += 1
        self._orphans = unseen

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every gradient submitted so far is reduced and (cross-iteration) applied.

        Call before evaluation, checkpointing, reading ``p.grad`` (synchronous path)
        or exit. Raises :class:`commsched.CommschedTimeout` instead of hanging, and
        :class:`commsched.SchedulerClosed` after :meth:`close` (which synchronized already)."""
        self._check_open()
        self._scheduler.synchronize(timeout)
        self._ready(self._params, "synchronize")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication (like DDP's ``no_sync``).
        The first backward outside the context reduces the accumulated gradients."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``. Gradients the scheduler owns are untouched."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` (same format), after :meth:`synchronize`
        (after :meth:`close`: the final state, which close applied)."""
        if not self._closed:
            self.synchronize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` or by the plain wrapped optimizer."""
        self.synchronize()
        self.optimizer.load_state_dict(state_dict)
        self.state = self.optimizer.state
        for s in self._params:
            if s.sub is not None:
                s.sub.state = self.optimizer.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initializing", False):
            return super().add_param_group(param_group)
        raise NotImplementedError("add parameter groups to the optimizer before wrapping it in DistributedOptimizer")

    def stats(self) -> dict[str, Any]:
        """Per-step bubble time (seconds the forward or ``step()`` blocked on communication,
        most recent steps last), totals, and the scheduler's counters (pieces, bytes, order)."""
        sched = self._scheduler.stats()
        return {
            "steps": self._steps,
            "bubble_s": list(self._bubbles),
            "bubble_total_s": float(sum(self._bubbles)),
            "pieces": sched["pieces"],
            "bytes": sched["bytes"],
            "cross_iteration": self._cross,
            "ordering": self.config.ordering,
            "priorities": {s.name: s.priority for s in sorted(self._params, key=lambda s: s.priority)},
            "scheduler": sched,
        }

    def close(self, timeout: float | None = None) -> None:
        """Apply what is pending (waiting at most ``timeout``, default ``timeout_s``), remove the
        hooks, close the scheduler (which closes the backend). Idempotent. ``with opt:`` closes
        too; after an exception it waits at most 5 s and lets that exception through."""
        if self._closed:
            return
        try:
            if self._scheduler.error is None:
                self.synchronize(timeout)
        finally:
            self._closed = True
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            self._scheduler.close(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise SchedulerClosed("this DistributedOptimizer is closed; create a new one to train further")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({self.optimizer!r}, ordering={self.config.ordering!r}, "
                f"world_size={self.world_size})")
