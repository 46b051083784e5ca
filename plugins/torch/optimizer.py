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

Updates reuse the user's optimizer class: one instance per module's parameters of one
param group (lean apply: one call per layer, for the element-wise ``torch.optim`` classes
of :data:`LEAN_APPLY`, where that is bitwise equal to the reference) or per parameter
(any other optimizer), built from the group's hyperparameters (refreshed before every
update, so LR schedulers work) and sharing the wrapped optimizer's ``state``, so
``state_dict()`` has the wrapped optimizer's format. Nothing is re-implemented.

``cross_iteration=False`` is the synchronous path: reductions still overlap with
backward, gradients land back in ``p.grad`` (averaged), ``synchronize()`` waits
for them (then clip, inspect...), and ``step()`` runs the wrapped optimizer's own
``step()`` once for all parameters.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import itertools
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from commsched.config import SchedulerConfig, check_config, read_environment
from commsched.errors import CommschedError, CommschedTimeout, SchedulerClosed
from commsched.lifecycle import Closeable
from commsched.order_check import CHECK_PREFIX, StepManifest, agree, digest_values, mismatch, split_lists
from commsched.plan import Plan, PlannedTensor, fused_name
from commsched.plan_agreement import agree_on_plan, check_plan, note_engine, store_gather
from commsched.policy import agrees_on_order
from commsched.scheduler import Scheduler, Task
from commsched.timeline import now_us
from commsched.tuner import (DDP_BUCKET_BYTES, DDP_SMALL_BUCKET_BYTES, PLANNED, REDUCER, UNLIMITED_BYTES, AgreedSwitch,
                             Decision, SearchSpace, Settings, Tuner, model_starts)
from commsched.plugins.torch.backends import (all_gather_rows, default_store, destroy_own_group, make_backend,
                                              own_group, resolve_backend)
from commsched.plugins.torch.cuda import CudaTask
from commsched.plugins.torch.tensor_ops import TorchOps, check_gradient
from commsched.costmodel.profile import Profile
from commsched.plugins.torch.profiler import StepRecorder, profile_recorded
from commsched.plugins.torch.reducer import DdpReducer, reducer_eligible

__all__ = ["DistributedOptimizer"]

log = logging.getLogger(__name__)

_instances = itertools.count()
_NEEDS_ALL_GRADIENTS = (torch.optim.LBFGS,)
_BUBBLE_HISTORY = 1000
_ISSUE_POLL_S = 0.25  # how often a forward waiting for its pieces to be queued checks for failures

_AMP_CROSS_ITERATION = (
    "GradScaler (AMP) needs the averaged gradients in p.grad before the update, but with cross_iteration=True "
    "the scheduler owns them (p.grad is None) and applies each layer in the next forward. Create the optimizer "
    "with config=commsched.SchedulerConfig(cross_iteration=False) and call scaler.scale(loss).backward(); "
    "scaler.step(opt); scaler.update() (call opt.synchronize() before scaler.unscale_(opt) if you clip), or use "
    "bfloat16 autocast, which needs no GradScaler")


#: The optimizers whose update of several parameters in one call is bitwise equal to one call each
#: (element-wise: each parameter's update reads only its own gradient and state). Lean apply
#: (``DistributedOptimizer._lean_group``) uses exactly these classes.
LEAN_APPLY = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
              torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
              torch.optim.Rprop)

# Horovod fuses pieces that are ready in the same cycle; measured on 2 ranks
# (docs/horovod.md), 1 MiB pieces with a 16 MiB credit did best with fusion on.
HOROVOD_PARTITION_BYTES = 1 << 20
# Without model= (no cross-iteration overlap) step() waits for every gradient, so no piece is needed
# sooner than another and cutting a tensor only adds pieces, each with its own Horovod negotiation and
# thread hand-offs: in Horovod's synthetic-benchmark shape 1 MiB pieces (10 per step instead of 3) ran
# behind hvd.DistributedOptimizer (docs/horovod.md). Pieces as large as Horovod fuses at once: only
# giant tensors (embedding tables) are cut, so priority and credit still apply between them.
HOROVOD_SYNC_PARTITION_BYTES = 64 << 20


def _default_config(backend: str, cross_iteration: bool = True) -> SchedulerConfig:
    """The config when none is given: the core's defaults (and ``COMMSCHED_*``), except the piece
    size on Horovod (``HOROVOD_PARTITION_BYTES``; without the cross-iteration overlap, e.g. no
    ``model=``, ``HOROVOD_SYNC_PARTITION_BYTES``) unless ``COMMSCHED_PARTITION_BYTES`` says otherwise."""
    if backend == "horovod" and "partition_bytes" not in read_environment():
        return SchedulerConfig(partition_bytes=HOROVOD_PARTITION_BYTES if cross_iteration
                               else HOROVOD_SYNC_PARTITION_BYTES)
    return SchedulerConfig()


_NO_MODEL_WARNING = (
    "DistributedOptimizer was created without model=: gradients are reduced by priority, in pieces and "
    "within the credit, but step() waits for all of them (no cross-iteration overlap). Pass "
    "model=your_module, e.g. DistributedOptimizer(opt, named_parameters=model.named_parameters(), model=model), "
    "to let the next forward start layer by layer while communication finishes.")


def _scaler_stage(scaler: Any, optimizer: Any) -> str:
    """The name of ``scaler``'s stage for ``optimizer`` (``READY``, ``UNSCALED``, ``STEPPED``): the
    state GradScaler lets an optimizer with ``_step_supports_amp_scaling`` query."""
    return scaler._per_optimizer_states[id(optimizer)]["stage"].name


def _horovod_torch() -> Any:
    """``horovod.torch`` if the user's script imported it (never imported here)."""
    return sys.modules.get("horovod.torch")


def _reduce_op(op: Any) -> str:
    """``"average"`` or ``"sum"`` for ``op`` (Horovod's ``hvd.Average``/``hvd.Sum`` or those words)."""
    if op is None:
        return "average"
    if isinstance(op, str) and op.lower() in ("average", "mean", "sum"):
        return "sum" if op.lower() == "sum" else "average"
    hvd = _horovod_torch()
    if hvd is not None and not isinstance(op, (str, bool)):
        if op == hvd.Average:
            return "average"
        if op == hvd.Sum:
            return "sum"
        if op == getattr(hvd, "Adasum", object()):
            raise ValueError("op=hvd.Adasum is not supported by commsched: it reduces by sum of pieces (sum then "
                             "divide); use op=hvd.Average (the default) or keep hvd.DistributedOptimizer for Adasum")
    raise ValueError(f"op={op!r} is not supported; use op=hvd.Average (the default, 'average') or op=hvd.Sum ('sum')")


def _check_compression(compression: Any) -> None:
    """Accept no compression only: Horovod's ``hvd.Compression.none`` or None."""
    if compression is None:
        return
    name = getattr(compression, "__name__", type(compression).__name__)
    if name == "NoneCompressor":
        return
    raise ValueError(f"compression={name} is not supported: commsched reduces gradients in their own dtype. "
                     "Drop compression= (or pass hvd.Compression.none)")


def _named(named_parameters: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """Horovod's ``named_parameters`` argument, checked as Horovod checks it."""
    if isinstance(named_parameters, dict):
        named_parameters = list(named_parameters.items())
    try:
        pairs = list(named_parameters)
    except TypeError:
        pairs = None
    if pairs is None or any(not (isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                 and isinstance(p[1], torch.Tensor)) for p in pairs):
        raise TypeError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                        "model.named_parameters()")
    names = [n for n, _ in pairs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"named_parameters has duplicate names {dupes}; each parameter needs its own name, as "
                         "model.named_parameters() gives")
    return pairs


def _is_named_parameters(value: Any) -> bool:
    """True for what a Horovod script passes second: ``model.named_parameters()`` (a generator) or a list of pairs."""
    return inspect.isgenerator(value) or (isinstance(value, (list, tuple)) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in value))


class _ParamState:
    """Bookkeeping for one parameter."""

    __slots__ = ("name", "param", "group", "priority", "future", "grad", "copy_back", "passes", "hyper",
                 "cuda", "fusion", "split", "landed", "pieces")

    def __init__(self, name: str, param: torch.nn.Parameter, group: dict, priority: int) -> None:
        self.name = name
        self.param = param
        self.group = group
        self.priority = priority
        self.future = None
        self.grad: Optional[torch.Tensor] = None
        self.copy_back: Optional[torch.Tensor] = None
        self.passes = 0
        self.hyper: Optional[dict] = None  # the group's hyperparameters when step() ended this gradient's step
        self.cuda: Optional[CudaTask] = None  # the stream/event record of the gradient in flight (CUDA)
        self.fusion: Optional["_Fusion"] = None  # the group this gradient is reduced in, if fused with others
        self.split: Any = None  # split_tied_embeddings: the TiedSplit that adds the lookup's rows (tied.py)
        # Ranged apply: the [start, stop) element ranges of the gradient in flight that landed (averaged),
        # in landing order; None where the whole gradient is applied at once (see _apply_as_landed)
        self.landed: Optional[list[tuple[int, int]]] = None
        self.pieces = 0  # ranged apply: the pieces the gradient in flight was cut into


class _Fusion:
    """Several small gradients reduced as one task over one flat buffer (a plan's fused group; the
    same mechanism serves any list of groups of parameter names).

    Each member's post-accumulate hook hands its gradient over; when the last member of the
    step is in, all are copied into the buffer (preallocated at first use, their one dtype)
    and the buffer is submitted as task ``name`` with the most urgent member's priority.
    Every member's future is the group's: once reduced (and averaged), a member's gradient
    is its slice of the buffer, applied by its module's pre-hook (cross-iteration) or copied
    back into ``p.grad`` (synchronous), exactly as an unfused one. The buffer is reused each
    step; no member's gradient can arrive before its previous update ran (the
    ``new gradient before its previous one was applied`` check covers every member).

    Two sources of groups: a plan's fused groups (``strict``), and ``fusion_bytes`` under the
    other orderings (:func:`size_groups`: runs of adjacent small gradients, built at the first
    backward from the order of first use, identical on every rank that runs the same forward).
    """

    __slots__ = ("name", "members", "bounds", "numel", "buffer", "arrived", "strict")

    def __init__(self, name: str, members: list[_ParamState], strict: bool = True) -> None:
        dtypes = {s.param.dtype for s in members}
        devices = {s.param.device for s in members}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"fusion group {name!r} mixes dtypes {sorted(map(str, dtypes))} or devices "
                             f"{sorted(map(str, devices))}; only gradients of one dtype on one device share a buffer")
        self.name, self.members = name, members
        # strict (a plan's group): a step in which only some members got a gradient is an error.
        # Otherwise (size-threshold fusion) those members are reduced one by one that step.
        self.strict = strict
        self.bounds: list[tuple[int, int]] = []
        offset = 0
        for s in members:
            self.bounds.append((offset, offset + s.param.numel()))
            offset += s.param.numel()
        self.numel = offset
        self.buffer: Optional[torch.Tensor] = None
        self.arrived: dict[int, torch.Tensor] = {}  # id(state) -> its gradient this step

    def missing(self) -> list[str]:
        return [s.name for s in self.members if id(s) not in self.arrived]


#: ``ordering="auto"`` and ``"planned"`` without a plan run this many steps as ``dynamic`` while the
#: recorder times them; rank 0 decides at the end of the last one, every rank switches two steps later.
ADAPT_RECORD_STEPS = 4
#: The planner's MILP budget when ``"planned"`` plans in-process (seconds, after its greedy grid).
PLAN_TIME_LIMIT_S = 10.0
#: The link bandwidth of the default topology (a flat ring of ``world_size`` nodes) that ``"auto"`` and
#: in-process ``"planned"`` model when no ``topology=`` is given; pass the one ``commsched probe`` measures.
DEFAULT_BANDWIDTH = "10gbit"
#: The tuner's settings (docs/tuning.md): 1 settle + 4 scored steps per sample, at most 20 samples, ending
#: in a final race of 2 fresh samples each of the incumbent and up to 2 runners-up within 8 % of its score; the
#: favoured setting there (the model's pick, else the best-scored of torch's reducer starts) is kept unless beaten by
#: more than 1.28 standard errors of the difference (one-sided, about 90 %).
TUNER_OPTIONS: dict[str, Any] = dict(sample_steps=4, settle=1, max_samples=20, min_gain=0.02, drift=0.05,
                                     check_every=50, race_samples=2, race_extend=True, race_width=3,
                                     race_margin=0.08, favour_z=1.28)
#: ``"auto"`` measures the planner's plan first where the model predicts it this much ahead of the
#: advised runtime setting, else not at all; None: the planner's own margin (``PlanSearch.min_gain``,
#: the model's measured error).
AUTO_PLAN_MIN_GAIN: float | None = None
#: The bucket sizes of the starts where ``auto`` measures torch's own reducer (DDP's): ``bucket_cap_mb`` 1 and 4,
#: the fastest DDPs on the bench's shaped and unshaped networks (docs/tuning.md)
REDUCER_BUCKETS = (1 << 20, 4 << 20)
#: The bucket sizes at which the plan ``ordering="planned"`` makes at runtime weighs DDP's own engine
#: (``PlanSearch.reducer_buckets``: where DDP's shape hides the communication in the model, the plan names
#: torch's reducer); () keeps the plan on commsched's pieces.
PLAN_REDUCER_BUCKETS: tuple[int, ...] = REDUCER_BUCKETS

tuner_log = logging.getLogger("commsched.tuner")


class _Reusable:
    """The engine, shared by the schedulers an optimizer makes one after another: closing a scheduler
    closes it, except during a switch (``keep_open``), when the next scheduler takes it over."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.keep_open = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def close(self) -> None:
        if not self.keep_open:
            self._backend.close()


def _load_topology(topology: Any) -> Any:
    """``topology=``: None, a :class:`commsched.costmodel.Topology`, or the path of its JSON."""
    if topology is None:
        return None
    from commsched.costmodel.topology import Topology

    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, (str, os.PathLike)):
        return Topology.from_json(os.fspath(topology))
    raise TypeError(f"topology must be a commsched.costmodel.Topology or the path of its JSON (from `commsched "
                    f"probe --json topology.json`), got {type(topology).__name__}")


def _group_key(process_group: Any) -> str:
    """Where a user's ``process_group`` puts its keys in the default store, which every rank of the job
    shares: the digest of its global ranks (two data-parallel groups of one job each have a rank 0 that
    decides, and their decisions must not land under the same key); "" for the default group's ranks."""
    if process_group is None:
        return ""
    ranks = ",".join(str(r) for r in dist.get_process_group_ranks(process_group))
    return "g" + hashlib.sha256(ranks.encode()).hexdigest()[:12] + "/"


def _check_split(split: Any, model: Any) -> list[tuple[str, torch.nn.Embedding]]:
    """``split_tied_embeddings``: the tied embeddings to split (empty when off); ``ValueError`` naming the
    fix where the split cannot run."""
    if not isinstance(split, bool):
        raise TypeError(f"split_tied_embeddings={split!r} must be True or False")
    if not split:
        return []
    if model is None:
        raise ValueError("split_tied_embeddings=True: it needs the model (model=your_module); or drop "
                         "split_tied_embeddings")
    from commsched.plugins.torch.tied import find_tied_embeddings

    tied = find_tied_embeddings(model)
    if not tied:
        raise ValueError("split_tied_embeddings=True, but the model has no nn.Embedding whose weight another module "
                         "registers too (e.g. lm_head.weight = wte.weight); drop split_tied_embeddings")
    return tied


def _check_tuner_importable() -> None:
    import importlib.util

    if importlib.util.find_spec("optuna") is None:
        raise ValueError("ordering='auto' tunes with Optuna, which is not installed: pip install optuna==5.0.0 "
                         "(or pip install 'commsched[tuner]'), or choose an ordering (ordering='dynamic')")


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (disjoint) with adjacent ones joined, in order: one update call for the pieces that
    landed together (in the engine's order they are mostly consecutive)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def size_groups(states: list[_ParamState], fusion_bytes: int) -> list[list[_ParamState]]:
    """Runs of adjacent small gradients to fuse, in the order of ``states``: each member smaller
    than ``fusion_bytes``, one dtype and device, together at most ``fusion_bytes``; runs of one
    are left alone (nothing to gain)."""
    groups: list[list[_ParamState]] = []
    run: list[_ParamState] = []
    total = 0

    def close_run() -> None:
        if len(run) > 1:
            groups.append(list(run))
        run.clear()

    for s in states:
        nbytes = s.param.numel() * s.param.element_size()
        if nbytes >= fusion_bytes or nbytes == 0:
            close_run()
            total = 0
            continue
        if run and (total + nbytes > fusion_bytes or s.param.dtype != run[0].param.dtype
                    or s.param.device != run[0].param.device):
            close_run()
            total = 0
        run.append(s)
        total += nbytes
    close_run()
    return groups


class DistributedOptimizer(torch.optim.Optimizer, Closeable):
    """Wrap ``optimizer`` so that its gradients are reduced by commsched.

    A drop-in for ``hvd.DistributedOptimizer``: ``DistributedOptimizer(optimizer,
    named_parameters=model.named_parameters(), compression=hvd.Compression.none,
    op=hvd.Average)`` takes Horovod's arguments, and ``hvd.broadcast_optimizer_state``
    works on it.

    Args:
        optimizer: any ``torch.optim`` optimizer (SGD, Adam, AdamW, RMSprop, Adagrad,
            ...); its class and hyperparameters do the updates.
        model: the module whose forward uses the parameters. With it, hooks on its
            modules let the next forward start layer by layer while communication
            finishes (cross-iteration overlap). Without it: priority, partition and
            credit, and ``step()`` waits for every gradient (one warning says so).
        config: a :class:`commsched.SchedulerConfig` (default: from ``COMMSCHED_*``).
        backend: ``"auto"`` (default: Horovod when ``horovod.torch`` is imported and
            initialized, else torch.distributed), ``"torch"`` (the default process
            group: gloo or NCCL) or ``"horovod"`` (raises
            :class:`commsched.errors.HorovodUnavailable` without Horovod).
        broadcast: broadcast parameters, buffers and optimizer state from rank 0 now.
        backward_passes_per_step: reduce only every k-th backward (gradient accumulation).
        process_group: a torch.distributed group other than the default one.
        named_parameters: Horovod's: ``(name, parameter)`` pairs naming the
            parameters (``model.named_parameters()``); their order is the priority
            until a forward shows the order of use.
        compression: Horovod's; only ``hvd.Compression.none`` (or None).
        op: ``hvd.Average`` (default) or ``hvd.Sum``; Adasum is refused.
        gradient_predivide_factor: Horovod's: divide by f before the sum and by
            ``size / f`` after (``op=hvd.Average`` only).
        num_groups, groups, sparse_as_dense, process_set: Horovod's; only their
            defaults are accepted (anything else raises ``ValueError`` saying why).

    Every bad argument raises ``TypeError``/``ValueError`` naming it before any
    thread, process group or hook exists; if the initial broadcast fails, the hooks
    and threads are removed before the error propagates.

    Guarantees: after ``synchronize()`` every parameter equals what plain synchronous
    training gives (all-reduce, divide by world size, ``optimizer.step()``) — bitwise
    on 2 ranks with a deterministic engine; every gradient is reduced once. A
    ``step()`` with no backward since the previous one (``hvd.broadcast_optimizer_state``
    does this with zero gradients) runs the wrapped optimizer's own step on ``p.grad``,
    without communication, and is not counted as a step.
    :meth:`close` (or leaving a ``with`` block) applies what is pending and stops the
    threads; a closed optimizer raises :class:`commsched.SchedulerClosed` when used.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
                 config: SchedulerConfig | None = None, *, backend: str = "auto", broadcast: bool = True,
                 backward_passes_per_step: int = 1, process_group: Optional["dist.ProcessGroup"] = None,
                 named_parameters: Optional[Iterable[tuple[str, torch.nn.Parameter]]] = None,
                 compression: Any = None, op: Any = None, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                 process_set: Any = None, topology: Any = None, split_tied_embeddings: bool = False) -> None:
        # Every check runs before any thread, process group or hook exists.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a torch.optim.Optimizer instance (e.g. "
                            "torch.optim.SGD(model.parameters(), "
                            f"lr=0.1)), got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once")
        if model is not None and not isinstance(model, torch.nn.Module) and _is_named_parameters(model):
            # hvd.DistributedOptimizer(opt, model.named_parameters()): Horovod's second argument.
            if named_parameters is not None:
                raise TypeError("named_parameters was given twice (second positional argument and keyword)")
            model, named_parameters = None, model
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError("model must be the torch.nn.Module whose parameters the optimizer updates (or leave it "
                            f"out), got {type(model).__name__}")
        check_config(config)
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
            raise TypeError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1 (the number "
                            "of backward passes whose gradients are accumulated before one reduction)")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1")
        if not isinstance(broadcast, bool):
            raise TypeError(f"broadcast={broadcast!r} must be True or False")
        self._op = _reduce_op(op)
        _check_compression(compression)
        if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)) \
                or not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a number > 0")
        if gradient_predivide_factor != 1.0 and self._op != "average":
            raise ValueError("gradient_predivide_factor != 1.0 needs op=hvd.Average (as in Horovod)")
        if num_groups or groups is not None:
            raise ValueError("num_groups/groups (Horovod's fixed fusion groups) are not supported: commsched cuts and "
                             "orders pieces itself (SchedulerConfig partition_bytes/credit_bytes); drop them")
        if sparse_as_dense:
            raise ValueError("sparse_as_dense=True is not supported: commsched reduces dense gradients only; use "
                             "nn.Embedding(sparse=False) and drop sparse_as_dense")
        if process_set is not None and getattr(process_set, "process_set_id", None) != 0:
            raise ValueError("process_set: commsched reduces over all Horovod ranks (the global process set); "
                             "drop process_set=")
        named = _named(named_parameters) if named_parameters is not None else None
        if isinstance(optimizer, _NEEDS_ALL_GRADIENTS):
            raise ValueError(
                f"{type(optimizer).__name__} needs a closure that re-evaluates the loss on all gradients at once, "
                "which per-parameter scheduled updates cannot provide; use it without commsched or reduce manually")
        backend = resolve_backend(backend)
        tied = _check_split(split_tied_embeddings, model)
        if backend == "horovod" and process_group is not None:
            raise ValueError("process_group is a torch.distributed group; backend='horovod' reduces over all "
                             "Horovod ranks (leave process_group=None)")
        if config is None:
            config = _default_config(backend, cross_iteration=model is not None and SchedulerConfig().cross_iteration)
        adaptive = config.ordering == "auto" or (config.ordering == "planned" and config.plan is None)
        if adaptive and model is None:
            raise ValueError(f"ordering={config.ordering!r}" + (" without plan=" if config.ordering == "planned"
                             else "") + " profiles the first steps layer by layer, which needs the model: pass "
                             "model=your_module (or give a plan file, or choose ordering='dynamic')")
        if config.priority == "slack" and model is None:
            raise ValueError("priority='slack' ranks tensors by their slack, which comes from a profile of the "
                             "first steps layer by layer and needs the model: pass model=your_module (or use "
                             "priority='layer')")
        if model is None and config.cross_iteration:
            warnings.warn(_NO_MODEL_WARNING, UserWarning, stacklevel=2)
            config = dataclasses.replace(config, cross_iteration=False)
        # ordering="auto", or "planned" without a plan: start as "dynamic", switch at agreed step boundaries
        self._requested = config
        self._adaptive = adaptive
        # a given plan that names DDP's engine (Plan.engine; known once every rank agreed on the plan): its pieces
        # until rank 0 switches every rank to torch's reducer at an agreed boundary (or keeps them, saying why)
        self._engine_switch = False
        self._topology = _load_topology(topology)
        if self._adaptive:
            if config.ordering == "auto":
                _check_tuner_importable()
            config = dataclasses.replace(config, ordering="dynamic")
        self.config = config
        self._params = self._collect(model, named, optimizer)
        self._predivide = float(gradient_predivide_factor)

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
        self._by_param = {id(s.param): s for s in self._params}
        self._hooks: list[Any] = []
        self._recording = model is not None  # first forward: learn the order of first use
        self._seen: set[int] = set()
        self._next_priority = 0
        self._sync_enabled = True
        self._backward_seen = False
        self._tasks_submitted = 0  # Scheduler.submit calls from the gradient hooks (profile(): their own cost)
        self._steps = 0
        self._bubble = 0.0
        self._bubbles: list[float] = []
        self._closed = False
        self._orphans: list[_ParamState] = []
        self._fusion_pending = True  # fusion_bytes: the groups are made at the first gradient
        # Update instances of the user's optimizer class: one per param group under lean apply (every
        # update of that group, whichever parameters it covers, since LEAN_APPLY classes keep all their
        # state in the shared ``state``), else one per parameter.
        self._subs: dict[tuple[int, ...], torch.optim.Optimizer] = {}
        self._lean = True
        # Ranged apply: a forward that waits for a gradient of several pieces updates each range of the
        # parameter as its piece lands (_apply_as_landed); the pieces' callbacks notify this condition.
        self._ranged = True
        self._landed_cv = threading.Condition()
        self._ranged_counts = {"updates": 0, "ranges": 0}  # gradients applied range by range; their ranges
        # Cross-iteration: the first forward pre-hook after step() also applies, in one call per param
        # group, every ended step's update whose reduction is already done (see _ready).
        self._sweep = False
        self._lean_cache: dict[int, bool] = {}
        # CUDA: (step, streams, event where the compute stream needed a gradient, its done event)
        self._gpu_waits: list[tuple] = []
        # auto's tuner may hand the gradients to torch's own C++ reducer (DDP's; reducer.py): while it runs,
        # the per-gradient path's hooks are removed. Whether every parameter got a gradient in every step so
        # far (its contract).
        self._reducer: Optional[DdpReducer] = None
        self._hooked = 0  # gradient hooks of this step
        self._every_grad = True
        # verify_order: what this rank submitted in the current step, in order (commsched.order_check)
        self._manifest = StepManifest()
        self._verifying = False  # _checks_order(self.config), set once the engine is known and at each switch
        self._order_checks = 0  # steps whose order was checked (stats()["order_checks"])

        # From here on threads and groups exist: any failure closes what was made.
        self._backend = make_backend(backend, process_group, self.config.timeout_s)
        self.backend = backend
        self.rank = self._backend.rank
        self.world_size = self._backend.world_size
        # Horovod averages in its own C++ loop (prescale 1/f, postscale f/size), as hvd.DistributedOptimizer
        # does: no division pass over each gradient in Python before submit or on the completion thread
        average_in_engine = getattr(self._backend, "average_in_engine", None)
        self._engine_averages = self._op == "average" and average_in_engine is not None and \
            average_in_engine(self._predivide)
        self._fusions: list[_Fusion] = []
        self.plan: Optional[Plan] = None
        self._engine = _Reusable(self._backend) if self._adaptive else self._backend
        self._epoch = 0  # schedulers made so far, minus one: each has its own key prefix
        self._sched_base_step = 0  # the optimizer step at which the current scheduler started
        self._retired: list[dict[str, Any]] = []  # stats of the schedulers replaced at switches
        self._switches: list[dict[str, Any]] = []  # every decision taken, on every rank
        self._tuner: Any = None  # rank 0 of ordering="auto", from the first decision on
        self._auto_plans: dict[str, dict] = {}  # rank 0 of auto: digest -> the plan of each planned start
        self._auto_notes: list[str] = []  # rank 0 of auto: what the cost model recommended, and why
        self._pending_decision: Optional[int] = None  # step k whose decision applies from k+2
        # auto and a plan made at runtime decide after the recorded steps; a plan naming the reducer as the first
        # step (which learns the order of first use and whether every parameter gets a gradient) ends
        self._next_decision: Optional[int] = ADAPT_RECORD_STEPS - 1 if self._adaptive else None
        self._last_step_end: Optional[float] = None
        # priority="slack": rank 0 (which alone decides dynamic's order) re-ranks after the recorded steps
        self._slack: dict[str, Any] = {"at_step": ADAPT_RECORD_STEPS} if config.priority == "slack" else {}
        try:
            store = None
            planned = self.config.ordering == "planned"
            if agrees_on_order(self.config, self.world_size, self._backend.negotiates_order) or (
                    (planned or self._adaptive) and self.world_size > 1 and not self._backend.negotiates_order) or \
                    self._checks_order(self.config):
                # planned: plan check, aborts (order priority/observed: decisions); a checked fifo: aborts, and
                # the lists that name the first tensor the ranks differ on
                store = default_store()
            self._store = store
            self._verifying = self._checks_order(self.config)
            prefix = self._prefix = f"commsched/{_group_key(process_group)}opt{next(_instances)}"
            if planned:
                self._start_plan(store, prefix)
                assert self.plan is not None
                if self.plan.engine == "reducer" and self.model is not None and backend == "torch":
                    self._engine_switch = True
                    self._engine = _Reusable(self._backend)  # the switch closes this scheduler, not the engine
                    self._next_decision = 0  # after the step that learns whether every parameter gets a gradient
                else:
                    note_engine(self.plan, f"backend={backend!r}" + ("" if self.model is not None else ", no model="))
            self._switch = AgreedSwitch(self.rank, self.world_size, store=store, prefix=prefix,
                                        timeout_s=self.config.timeout_s,
                                        broadcast=lambda obj: self._backend.broadcast_object(obj, 0))
            self._scheduler = Scheduler(self._engine, TorchOps(), self.config, store=store, key_prefix=prefix)
        except BaseException:
            self._backend.close()
            raise
        self.timeline = self._scheduler.timeline
        self._split_states: list[_ParamState] = []  # split_tied_embeddings: the tied weights' states
        try:
            if tied:
                self._split_tied(tied)
            self._install_hooks()
            if broadcast and self.world_size > 1:
                self._broadcast_from_rank0()
        except BaseException:
            self._abandon()
            raise

    def _start_plan(self, store: Any, prefix: str, source: Any = None) -> None:
        """``ordering="planned"``: check the plan against this model and world, agree on it with every
        rank (``PlanMismatch`` on every rank otherwise, before any step), then fuse its groups and
        set up its algorithms. Every rank runs this at the same point (it may create process groups)."""
        source = self.config.plan if source is None else source
        entries = [PlannedTensor(s.name, s.param.numel(), s.param.element_size(), tuple(s.param.shape),
                                 str(s.param.dtype).removeprefix("torch.")) for s in self._params]
        try:
            found: Plan | BaseException = check_plan(source, entries, self.world_size)
        except (ValueError, OSError) as exc:  # PlanMismatch is a ValueError too
            found = exc
        gather = None
        if self.world_size > 1:
            if store is not None:
                gather = store_gather(store, prefix, self.rank, self.world_size, self.config.timeout_s)
            else:  # an engine that negotiates order (Horovod): its own object all-gather
                gather = self._backend.all_gather_object
        plan = agree_on_plan(found, rank=self.rank, world_size=self.world_size, gather=gather, source=source)
        self.plan = plan
        self.config = dataclasses.replace(self.config, plan=plan, credit_bytes=plan.credit_bytes)
        self._fuse([(g.name, list(g.tensors)) for g in plan.groups if g.fused])
        if any(p.algorithm == "hierarchical" for p in plan.pieces) and hasattr(self._backend, "use_hierarchical"):
            self._backend.use_hierarchical(plan.nodes, plan.ranks_per_node)

    def _fuse(self, groups: list[tuple[str, list[str]]], strict: bool = True) -> None:
        """Reduce each ``(task name, [parameter names])`` group as one task over a flat buffer
        (:class:`_Fusion`). A parameter may be in one group only; names must be this optimizer's.
        ``strict``: every member must get a gradient every step (a plan's groups)."""
        by_name = {s.name: s for s in self._params}
        for name, members in groups:
            unknown = [m for m in members if m not in by_name]
            if unknown:
                raise ValueError(f"fusion group {name!r} names {unknown[:5]}, which are not parameters with a "
                                 "gradient in this optimizer")
            states = [by_name[m] for m in members]
            taken = [s.name for s in states if s.fusion is not None]
            if taken:
                raise ValueError(f"parameters {taken[:5]} are in two fusion groups")
            fusion = _Fusion(name, states, strict)
            for s in states:
                s.fusion = fusion
            self._fusions.append(fusion)

    # ------------------------------------------------ agreed switches (auto, planned without a plan)
    def _at_boundary(self, ended: int) -> None:
        """End of step ``ended`` (every rank, user's thread). Rank 0 measures the step's period; at a
        decision step it decides and publishes (:class:`commsched.tuner.AgreedSwitch`); one step later
        every rank takes the decision and, if it changes anything, switches, so step ``k + 2`` runs it."""
        now = time.perf_counter()
        if self._last_step_end is not None and self._tuner is not None:
            self._tuner.observe(ended, now - self._last_step_end)
        if self._pending_decision is not None and ended == self._pending_decision + 1:
            decided, self._pending_decision = self._pending_decision, None
            decision = self._switch.take(decided)
            self._next_decision = decision.next
            self._apply_decision(decided, decision)
        if self._next_decision is not None and ended == self._next_decision:
            if self.rank == 0:
                self._switch.publish(ended, self._decide(ended))
            self._pending_decision = ended
            self._next_decision = None  # the decision names the next one
        self._last_step_end = time.perf_counter()  # a switch's own time is not the next step's

    def _decide(self, ended: int) -> Decision:
        """Rank 0, at the end of decision step ``ended``: plan (``planned``) or ask the tuner (``auto``).
        A failure becomes an error every rank raises at the same step."""
        try:
            if self._engine_switch:
                return self._engine_decision()
            if self._requested.ordering == "planned":
                return self._plan_decision()
            if self._tuner is None:
                self._tuner = self._make_tuner()
                return self._with_plan(self._tuner.first(ended))
            return self._with_plan(self._tuner.decide(ended))
        except Exception as exc:  # noqa: BLE001 - every rank must hear why
            tuner_log.exception("rank 0 could not decide the settings at step %d", ended)
            return Decision(error=f"{type(exc).__name__}: {exc}", reason="failed")

    def _rank_by_slack(self) -> None:
        """``priority="slack"``, at the end of the recorded steps: give every parameter the priority
        the seed's slack rule computes from their profile on the topology
        (:mod:`commsched.costmodel.slack`). Under ``dynamic`` only rank 0's priorities order the
        pieces (the others follow its decisions), so only rank 0 changes; later steps' tasks carry
        the new priorities. If the model cannot rank them, layer order stays (logged)."""
        if self.rank != 0:
            self._slack["role"] = "follows rank 0"
            return
        from commsched.costmodel.slack import slack_order

        try:
            order = slack_order(self.profile(), self._topology_or_default(), self.config.slack_alpha)
        except Exception as exc:  # noqa: BLE001 - layer order is a correct fallback
            tuner_log.warning("priority='slack': no slack ranking (%r); layer order stays", exc)
            self._slack["error"] = repr(exc)
            return
        ranked = order.tensor_priority
        rest = sorted((s for s in self._params if s.name not in ranked), key=lambda s: s.priority)
        for s in self._params:
            if s.name in ranked:
                s.priority = ranked[s.name]
        for i, s in enumerate(rest):
            s.priority = len(ranked) + i
        self._next_priority = len(ranked) + len(rest)
        self._slack.update(layers_moved=order.moved, layer_order=list(order.layer_order),
                           slack_s=[round(x, 6) for x in order.slack_s])
        tuner_log.info("priority='slack' from step %d: %d layers moved out of layer order (alpha %g)",
                       self._steps, order.moved, order.alpha)

    def _topology_or_default(self) -> Any:
        from commsched.costmodel.topology import Topology

        if self._topology is not None:
            return self._topology
        return Topology.described(f"{self.world_size}x1", intra=DEFAULT_BANDWIDTH, inter=DEFAULT_BANDWIDTH)

    def _plan_decision(self) -> Decision:
        try:
            from commsched.costmodel.planner import PlanSearch, make_plan
        except ImportError as exc:
            raise ImportError(f"ordering='planned' without a plan needs the planner ({exc}): pip install "
                              "highspy==1.16.0, or pass plan=<a plan JSON>") from exc
        started = time.monotonic()
        profile = self.profile()
        result = make_plan(profile, self._topology_or_default(),
                           PlanSearch.for_profile(profile, reducer_buckets=PLAN_REDUCER_BUCKETS),
                           time_limit_s=PLAN_TIME_LIMIT_S)
        reason = (f"planned from the profile of steps 0-{ADAPT_RECORD_STEPS - 1} in {time.monotonic() - started:.1f} "
                  f"s: predicted step {result.step_time_s * 1e3:.2f} ms")
        tuner_log.info("planner: %s; digest %s", reason, result.plan.digest)
        settings = None
        if result.plan.engine == "reducer":
            settings, why = self._reducer_for(result.plan)
            reason = f"{reason}; {why}"
        return Decision(settings, plan=result.plan.to_dict(), reason=reason)

    def _engine_decision(self) -> Decision:
        """Rank 0, at the end of step 0 of a given plan that names DDP's engine (every rank holds the plan)."""
        assert self.plan is not None
        settings, reason = self._reducer_for(self.plan)
        return Decision(settings, reason=reason)

    def _reducer_for(self, plan: Plan) -> tuple[Optional[Settings], str]:
        """Rank 0: torch's reducer with the buckets of ``plan``, which names DDP's engine, or (where the reducer
        cannot run) None, so the plan's own pieces run (DDP's shape); and why."""
        why_not = self._reducer_unavailable()
        if why_not is not None:
            reason = (f"plan {plan.digest[:12]} names DDP's reducer, which cannot run here ({why_not}): its pieces "
                      "(DDP's shape) run on commsched")
            tuner_log.warning("%s", reason)
            return None, reason
        reason = f"plan {plan.digest[:12]} names DDP's reducer: buckets of {plan.bucket_bytes} B"
        tuner_log.info("%s", reason)
        return Settings(REDUCER, UNLIMITED_BYTES, UNLIMITED_BYTES, plan.bucket_bytes, cross_iteration=False), reason

    def _make_tuner(self) -> Any:
        """The tuner of ``ordering="auto"``: starts at the cost model's recommendations for the profile
        of the first steps on the topology (:func:`commsched.tuner.model_starts`: the planner's plan
        where it is predicted more than :data:`AUTO_PLAN_MIN_GAIN` ahead, then the advised setting, which
        is the config's own unless the model puts another more than its error ahead), then the config's
        own settings, plain fifo without partition or credit, and DDP itself: torch's C++ reducer with
        1 and 4 MiB buckets (:data:`REDUCER_BUCKETS`; the fastest DDPs on the bench's networks), which
        wins where communication is hidden already and commsched's per-piece Python is all it adds
        (docs/tuning.md). Where the reducer cannot run (Horovod, an unused parameter in a recorded
        step, gradient accumulation, split tied embeddings: :meth:`_reducer_unavailable`), DDP's shape
        inside commsched instead: fifo on the synchronous path with small buckets as the fusion
        threshold (:data:`DDP_SMALL_BUCKET_BYTES`) and with DDP's default bucket (:data:`DDP_BUCKET_BYTES`).
        Where the planner, weighing the reducer at those buckets, names DDP's engine (communication hidden in
        the model), that reducer start is the tuner's ``favoured``: it races at the end whatever its search
        samples scored, and only a setting faster by more than the noise replaces it. Where the model picks
        nothing, the reducer starts are the tuner's ``safe`` settings: the best-scored of them is favoured so."""
        cross, direct = self._requested.cross_iteration, self._requested.direct_start
        own = Settings("dynamic", self._requested.partition_bytes, self._requested.credit_bytes,
                       self._requested.fusion_bytes, cross_iteration=cross, direct_start=direct)
        plain_fifo = Settings("fifo", UNLIMITED_BYTES, UNLIMITED_BYTES, self._requested.fusion_bytes,
                              cross_iteration=cross, direct_start=direct)
        # The synchronous path is the tuner's to choose only where the user asked for cross-iteration
        # (a user who asked for the synchronous path reads p.grad or uses a closure or AMP: it stays).
        # direct_start is the tuner's where a completion may start the next piece (gloo's path): measured
        # faster on comm-heavy and slower where compute fills the cores (docs/tuning.md), so the config's
        # own settings are measured both ways; elsewhere it would only move the order thread's starts.
        both = bool(getattr(self._backend, "starts_in_done", False))
        space = SearchSpace(cross_iterations=(True, False) if cross else (False,),
                            direct_starts=(False, True) if both else (direct,))
        twin = (dataclasses.replace(own, direct_start=not direct),) if both else ()
        why_not = self._reducer_unavailable()
        if why_not is None:
            ddp = tuple(Settings(REDUCER, UNLIMITED_BYTES, UNLIMITED_BYTES, b, cross_iteration=False)
                        for b in REDUCER_BUCKETS)
        else:
            ddp = tuple(Settings("fifo", UNLIMITED_BYTES, UNLIMITED_BYTES, b, cross_iteration=False,
                                 direct_start=direct) for b in (DDP_SMALL_BUCKET_BYTES, DDP_BUCKET_BYTES))
        last = (plain_fifo, *ddp)
        found = model_starts(self.profile(), self._topology_or_default(), self._requested.fusion_bytes,
                             plan_min_gain=AUTO_PLAN_MIN_GAIN, plan_time_limit_s=PLAN_TIME_LIMIT_S, default=own,
                             reducer_buckets=REDUCER_BUCKETS if why_not is None else ())
        for note in found.notes:
            tuner_log.info("%s", note)
        self._auto_plans, self._auto_notes = found.plans, list(found.notes)
        if why_not is not None:
            self._auto_notes.append(f"torch's reducer is not among the starts: {why_not}")
            tuner_log.info("%s", self._auto_notes[-1])
        starts = [dataclasses.replace(s, direct_start=direct, cross_iteration=s.cross_iteration if s.ordering == PLANNED
                                      or s.cross_iteration in space.cross_iterations else cross)
                  for s in found.starts] or [own]
        favoured = found.favoured if found.favoured in ddp else None  # one of the starts, so the search measures it
        # Where the model picks nothing, DDP's own engine is the safe choice: commsched's path replaces it only
        # where it measured faster beyond the noise ("nobody loses by turning commsched on")
        return Tuner(starts[0], extra_starts=(*starts[1:], own, *twin, *last), space=space, favoured=favoured,
                     safe=ddp if why_not is None else (), **TUNER_OPTIONS)

    def _with_plan(self, decision: Decision) -> Decision:
        """Rank 0: a decision to run a planned start carries its plan, for every rank."""
        if decision.settings is not None and decision.settings.ordering == PLANNED:
            decision.plan = self._auto_plans[decision.settings.plan]
        return decision

    def _apply_decision(self, decided: int, decision: Decision) -> None:
        """Every rank, at the end of step ``decided + 1``: the same change, or the same error."""
        record = {"decided_at": decided, "applies_from": decided + 2, "reason": decision.reason,
                  "settings": decision.settings.to_dict() if decision.settings else None,
                  "plan": decision.plan is not None}
        self._switches.append(record)
        if decision.error is not None:
            self._next_decision = None
            raise CommschedError(f"rank 0 could not choose the settings for ordering="
                                 f"{self._requested.ordering!r} at step {decided}: {decision.error}; pass the "
                                 "settings yourself (ordering='dynamic', or a plan file for 'planned')")
        if decision.settings is not None and decision.settings.ordering == REDUCER:
            # torch's reducer: commsched's scheduler idles (fifo, synchronous, nothing submitted). A plan that
            # names this engine (made now, or given) stays the optimizer's plan.
            plan = (Plan.from_dict(decision.plan) if decision.plan is not None else
                    self.plan if self._engine_switch else None)
            self._rebuild(dataclasses.replace(self.config, ordering="fifo", partition_bytes=UNLIMITED_BYTES,
                                              credit_bytes=UNLIMITED_BYTES, fusion_bytes=0, plan=None,
                                              cross_iteration=False),
                          reducer_bytes=decision.settings.fusion_bytes)
            self.plan = plan
        elif decision.plan is not None:  # a plan runs on the path the user asked for
            direct = decision.settings.direct_start if decision.settings is not None else self._requested.direct_start
            self._rebuild(dataclasses.replace(self.config, ordering="planned", plan=None,
                                              cross_iteration=self._requested.cross_iteration, direct_start=direct),
                          plan=Plan.from_dict(decision.plan))
        elif decision.settings is not None:
            st = decision.settings
            self._rebuild(dataclasses.replace(self.config, ordering=st.ordering, partition_bytes=st.partition_bytes,
                                              credit_bytes=st.credit_bytes, fusion_bytes=st.fusion_bytes, plan=None,
                                              cross_iteration=st.cross_iteration, direct_start=st.direct_start))

    def _rebuild(self, config: SchedulerConfig, plan: Optional[Plan] = None,
                 reducer_bytes: Optional[int] = None) -> None:
        """Replace the scheduler with one of ``config`` (and ``plan``), with nothing in flight: every
        gradient submitted so far is reduced and applied first; fusion groups are made anew.
        ``reducer_bytes``: torch's reducer, with buckets of that size, reduces from the next forward on
        (the step boundary: its last backward, if it ran one, finished in ``step()``)."""
        if not isinstance(self._engine, _Reusable):
            # closing the old scheduler would close the process group the next one (and torch's reducer) needs:
            # torch's Reducer then crashes the process (SIGSEGV in ProcessGroup::getDefaultBackend)
            raise CommschedError(f"this DistributedOptimizer (ordering={self._requested.ordering!r}) cannot change "
                                 "its settings during training: only ordering='auto', and 'planned' with a plan "
                                 "that names torch's reducer, switch at a step boundary; make a new optimizer")
        self.synchronize()
        self._close_reducer()
        old = self._scheduler
        self._retired.append(dict(old.stats(), base_step=self._sched_base_step))
        self._engine.keep_open = True
        try:
            old.close()
        finally:
            self._engine.keep_open = False
        for s in self._params:
            s.fusion = None
        self._fusions, self.plan, self._fusion_pending = [], None, True
        self._epoch += 1
        prefix = f"{self._prefix}/e{self._epoch}"
        self.config = config
        self._verifying = self._checks_order(config)
        # Nothing is in flight and every update is applied (synchronize() above), so the path may change
        # here: the hooks read it per gradient and per step (auto's tuner may choose the synchronous path).
        self._cross = config.cross_iteration
        try:
            if plan is not None:
                self._start_plan(self._store, prefix, source=plan)
            self._scheduler = Scheduler(self._engine, TorchOps(), self.config, store=self._store, key_prefix=prefix,
                                        timeline=self.timeline)
        except BaseException:
            # no scheduler owns the engine now (the old one is closed): close it here, or its process
            # group and threads would outlive close() (a peer that died during the switch, say)
            try:
                self._backend.close()
            except Exception:  # noqa: BLE001 - the switch's own error is the one to report
                log.exception("closing the backend after a failed switch")
            raise
        self._sched_base_step = self._steps
        if reducer_bytes is not None:
            self._start_reducer(reducer_bytes)

    def _start_reducer(self, bucket_bytes: int) -> None:
        """From the next forward on, torch's reducer (buckets of ``bucket_bytes``) reduces every gradient and
        commsched's scheduler idles. At a step boundary with nothing in flight, on the synchronous path
        (``_rebuild`` for ``auto``; the bench's ``reducer`` strategy right after construction)."""
        why_not = self._reducer_unavailable()
        if why_not is None and self._cross:
            why_not = "it runs on the synchronous path only (cross_iteration=False)"
        if why_not is None and self._recording:
            why_not = "the first step (which learns the order of first use) has not ended"
        if why_not is not None:
            raise CommschedError(f"torch's reducer cannot reduce this optimizer's gradients: {why_not}")
        self._reducer = DdpReducer([s.param for s in self._params], self._backend.group, bucket_bytes,
                                   [s.name for s in self._params])
        self._remove_path_hooks()  # no hook per gradient or layer: the reducer's own run in C++

    def _close_reducer(self, resume: bool = True) -> None:
        """Stop torch's reducer (at a step boundary); ``resume``: commsched's per-gradient path takes over."""
        reducer, self._reducer = getattr(self, "_reducer", None), None
        if reducer is not None:
            reducer.close()
            if resume:
                self._install_path_hooks()

    def _reducer_unavailable(self) -> Optional[str]:
        """Why torch's reducer may not stand in here (:func:`~commsched.plugins.torch.reducer.reducer_eligible`)."""
        return reducer_eligible(backend=self.backend, op=self._op, predivide=self._predivide,
                                passes=self.backward_passes_per_step, split=bool(self._split_states),
                                has_model=self.model is not None,
                                every_param_every_step=self._every_grad and not self._orphans,
                                params=[s.param for s in self._params])

    def _abandon(self) -> None:
        """Undo a constructor that failed after the threads started: remove the hooks,
        close the scheduler (and with it the backend) without waiting for pieces."""
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._remove_path_hooks()
        self._close_reducer(resume=False)
        self._close_splits()
        try:
            self._scheduler.close(5.0)
        except Exception:  # the constructor's own error is the one to report
            log.exception("closing the scheduler after a failed DistributedOptimizer constructor")

    def _split_tied(self, tied: list[tuple[str, torch.nn.Embedding]]) -> None:
        """``split_tied_embeddings``: one :class:`~commsched.plugins.torch.tied.TiedSplit` per tied
        embedding, its rows exchanged on a process group of its own (made here by every rank of the default
        group, or of the user's ``process_group``, in one order), or on Horovod by its allgather under a name
        of their own."""
        from commsched.plugins.torch.tied import TiedSplit

        horovod = getattr(self._backend, "all_gather_rows", None)  # Horovod: its allgather, matched by name
        user_group = getattr(self._backend, "user_group", None)
        group = own_group(self.config.timeout_s, user_group) if self.world_size > 1 and horovod is None else None
        self._split_group = group  # destroyed by _close_splits
        scale = 1.0 / self.world_size if self._op == "average" else 1.0
        for name, module in tied:
            state = self._by_param.get(id(module.weight))
            if state is None:
                raise ValueError(f"split_tied_embeddings: the weight of tied embedding {name!r} is not among the "
                                 "optimizer's parameters with a gradient; give the optimizer model.parameters()")
            gather = None  # one rank: its own rows are every rank's
            if horovod is not None:  # one name per embedding, the same on every rank
                gather = functools.partial(horovod, name=f"commsched.tied.{name}")
            elif group is not None:
                gather = functools.partial(all_gather_rows, group=group)
            state.split = TiedSplit(name or "embedding", module, gather=gather, scale=scale,
                                    timeout_s=self.config.timeout_s)
            self._split_states.append(state)

    def _close_splits(self) -> None:
        for s in getattr(self, "_split_states", ()):
            try:
                s.split.close()
            except Exception:  # noqa: BLE001 - closing must go on
                log.exception("closing the split of tied embedding %r", s.split.name)
        group, self._split_group = getattr(self, "_split_group", None), None
        if group is not None:
            try:
                destroy_own_group(group)
            except Exception:  # noqa: BLE001 - closing must go on
                log.exception("destroying the tied embeddings' process group")

    # --------------------------------------------------------------- set-up
    @staticmethod
    def _collect(model: torch.nn.Module | None, named: list | None,
                 optimizer: torch.optim.Optimizer) -> list[_ParamState]:
        """One state per parameter that needs a gradient, named after the model (or
        ``named_parameters``) and prioritised by its order there, a stand-in until the
        first forward shows the order of use."""
        if model is not None:
            pairs, where = list(model.named_parameters()), "model.named_parameters()"
        elif named is not None:
            pairs, where = named, "named_parameters"
        else:  # Horovod's names when none are given; the same on every rank
            pairs = [(f"param.{g}.{i}", p) for g, group in enumerate(optimizer.param_groups)
                     for i, p in enumerate(group["params"])]
            where = "the optimizer"
        names = {id(p): n for n, p in pairs}
        states, seen = [], set()
        order = {id(p): i for i, (_, p) in enumerate(pairs)}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"the optimizer holds a parameter that is not in {where} "
                        f"(shape {tuple(p.shape)}); pass the model (or named_parameters) whose parameters the "
                        "optimizer updates")
                if id(p) in seen:
                    raise ValueError(f"parameter {names[id(p)]!r} appears twice in the optimizer's param_groups")
                seen.add(id(p))
                if p.requires_grad:
                    states.append(_ParamState(names[id(p)], p, group, order[id(p)]))
        if not states:
            raise ValueError("the optimizer has no parameter that requires a gradient")
        return states

    def _install_hooks(self) -> None:
        self._recorder: StepRecorder | None = None  # with a model: profile()'s timings
        self._path_hooks: list[Any] = []
        self._install_path_hooks()
        if self.model is None:  # no forward hooks: the synchronous path waits in step()
            return
        for module in self.model.modules():
            mine = [self._by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in self._by_param]
            if mine:
                # A checkpoint holds every ended step's update: model.state_dict() (torch.save on rank 0)
                # and load_state_dict() (every rank) apply them first, as DDP's parameters would be.
                checkpoint = self._make_checkpoint_hook(mine)
                self._hooks.append(module.register_state_dict_pre_hook(checkpoint))
                self._hooks.append(module.register_load_state_dict_pre_hook(checkpoint))
        # The root waits for parameters whose module never runs its own forward, and arms torch's reducer.
        self._hooks.append(self.model.register_forward_pre_hook(self._root_pre_hook))

    def _install_path_hooks(self) -> None:
        """The per-gradient path's hooks: one per gradient (submit), one per layer's forward (wait and
        apply), the recorder's timings. Removed while torch's reducer runs (it needs none of them and
        their Python calls are what it saves), installed again when it stops."""
        for state in self._params:
            self._path_hooks.append(state.param.register_post_accumulate_grad_hook(self._make_grad_hook(state)))
        if self.model is None:
            return
        for module in self.model.modules():
            mine = [self._by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in self._by_param]
            if mine:
                self._path_hooks.append(module.register_forward_pre_hook(self._make_pre_hook(mine)))
        # profile(): per-layer timings of the last few steps (a bounded ring); close() removes its hooks.
        self._recorder = StepRecorder(self.model, [(s.name, s.param) for s in self._params],
                                      waited=lambda: self._bubble, optimizer=self.optimizer)
        self._path_hooks.extend(self._recorder.handles)

    def _remove_path_hooks(self) -> None:
        for handle in getattr(self, "_path_hooks", ()):
            handle.remove()
        self._path_hooks = []

    def _broadcast_from_rank0(self) -> None:
        tensors = itertools.chain(self.model.parameters(), self.model.buffers()) if self.model is not None \
            else (s.param for s in self._params)
        with torch.no_grad():
            for tensor in tensors:
                self._backend.broadcast(tensor, 0)
        state = self._backend.broadcast_object(self.optimizer.state_dict() if self.rank == 0 else None, 0)
        if self.rank != 0 and state is not None and state.get("state"):
            self.optimizer.load_state_dict(state)

    # ----------------------------------------------------------------- hooks
    def _make_grad_hook(self, state: _ParamState) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._backward_seen = True
            if not self._sync_enabled:
                return
            self._hooked += 1
            state.passes += 1
            if state.passes < self.backward_passes_per_step:
                return
            state.passes = 0
            recorder = self._recorder
            if recorder is None:
                self._submit(state)
                return
            # profile(): the hook's own time, which the cost model charges apart, and whether it submitted a task
            t0, tasks = time.perf_counter(), self._tasks_submitted
            try:
                self._submit(state)
            finally:
                recorder.hooked(param, time.perf_counter() - t0, submitted=self._tasks_submitted > tasks)
        return hook

    def _fuse_small(self) -> None:
        """``fusion_bytes``: fuse runs of adjacent small gradients. Called at the first gradient, when
        the first forward has given every used parameter its priority (order of first use); parameters
        the forward did not use stay alone. Without a model: the registration order."""
        self._fusion_pending = False
        if self.config.fusion_bytes <= 0 or self.config.ordering == "planned" or self._fusions:
            return
        if self.model is not None:
            states = sorted((s for s in self._params if id(s.param) in self._seen), key=lambda s: s.priority)
        else:
            states = list(self._params)
        states = [s for s in states if s.split is None]  # a split tied embedding adds its rows to its own tensor
        groups = size_groups(states, self.config.fusion_bytes)
        self._fuse([(fused_name(s.name for s in g), [s.name for s in g]) for g in groups], strict=False)

    def _submit(self, state: _ParamState) -> None:
        grad = state.param.grad
        if grad is None:
            return
        if self._fusion_pending:
            self._fuse_small()
        check_gradient(state.name, grad)
        if state.future is not None:
            raise CommschedError(
                f"parameter {state.name!r} got a new gradient before its previous one was applied; this happens "
                "when a parameter is used outside its module's forward. Call opt.synchronize() before that backward")
        if state.fusion is not None:
            self._submit_fused(state, grad)
            return
        if state.split is not None:
            state.split.arm()  # this pass synchronizes: its lookup's rows go at once, with the earlier passes'
        if self._cross:
            state.param.grad = None  # the scheduler owns this gradient until the update
        self._submit_alone(state, grad)

    def _submit_alone(self, state: _ParamState, grad: torch.Tensor) -> None:
        """Submit ``grad`` (``state``'s gradient, which ``p.grad`` no longer holds cross-iteration) as a task."""
        buffer = grad if grad.is_contiguous() else grad.contiguous()
        if self._predivide != 1.0 and not self._engine_averages:
            buffer.div_(self._predivide)  # Horovod's gradient_predivide_factor: f before the sum, size/f after
        state.copy_back = grad if buffer is not grad else None
        state.grad = buffer
        ready = None
        streams_for = getattr(self._backend, "streams_for", None)  # torch.distributed: CUDA streams and events
        streams = streams_for(buffer) if streams_for is not None else None
        if streams is not None:
            # Readiness: the communication stream waits for this point of the compute stream;
            # the division runs on the communication stream after the last piece (cuda.py).
            ready = state.cuda = CudaTask(streams, streams.record_ready(buffer),
                                          self._divisor() if self._op == "average" else None)
        state.pieces = self._rangeable_pieces(state, buffer) if streams is None else 0
        state.landed = [] if state.pieces else None
        if state.landed is not None:  # each piece is averaged as it lands (_piece_landed), not the whole at the end
            self._note_submit(state.name, buffer)
            state.future = self._scheduler.submit(state.name, buffer, state.priority,
                                                  on_piece=functools.partial(self._piece_landed, state))
            self._tasks_submitted += 1
            state.future.add_done_callback(self._wake_landed)  # a failure ends a wait for the next range too
            return
        self._note_submit(state.name, buffer)
        state.future = self._scheduler.submit(state.name, buffer, state.priority, ready=ready,
                                              on_done=None if self._engine_averages else self._after_reduce)
        self._tasks_submitted += 1

    def _rangeable_pieces(self, state: _ParamState, buffer: torch.Tensor) -> int:
        """The number of pieces of ``state``'s gradient if it may be applied range by range as they land,
        else 0: cross-iteration, a lean-apply group (element-wise updates, bitwise equal whatever the
        split: _lean_group), on the parameter's own contiguous memory, averaged by us (not by the
        engine), in more than one piece."""
        if not self._may_range(state):
            return 0
        pieces = len(self._scheduler.bounds(buffer.numel(), buffer.element_size(), state.name))
        return pieces if pieces > 1 else 0

    def _may_range(self, state: _ParamState) -> bool:
        """Whether ``state``'s gradient may be applied range by range (given more than one piece, and an
        optimizer state that allows it now: :meth:`_ranged_now`)."""
        return (self._cross and self._ranged and not self._engine_averages and state.copy_back is None
                and state.split is None and state.param.is_contiguous() and self._lean_group(state.group))

    def _wake_landed(self, future: Any) -> None:
        with self._landed_cv:
            self._landed_cv.notify_all()

    def _piece_landed(self, state: _ParamState, piece: Any) -> None:
        """The engine's thread, as each piece of a ranged gradient lands: average it, then tell a waiting forward."""
        if self._op == "average":
            piece.view.div_(self._divisor())
        with self._landed_cv:
            if state.landed is not None:
                state.landed.append((piece.start, piece.stop))
                self._landed_cv.notify_all()

    def _submit_fused(self, state: _ParamState, grad: torch.Tensor) -> None:
        """One member of a fusion group is ready; the last one copies all into the buffer and submits it."""
        fusion = state.fusion
        if id(state) in fusion.arrived:
            raise CommschedError(f"parameter {state.name!r} got a second gradient in one step before the rest of "
                                 f"its fusion group {fusion.name!r} ({fusion.missing()[:5]} missing); call "
                                 "opt.step() between backward passes")
        fusion.arrived[id(state)] = grad
        if self._cross:
            state.param.grad = None  # the scheduler owns this gradient until the update
        if len(fusion.arrived) < len(fusion.members):
            return
        busy = [s.name for s in fusion.members if s.future is not None]
        if busy:
            raise CommschedError(f"fusion group {fusion.name!r}: parameters {busy[:5]} got a new gradient before "
                                 "their previous one was applied; call opt.synchronize() before that backward")
        if fusion.buffer is None:
            fusion.buffer = torch.empty(fusion.numel, dtype=grad.dtype, device=grad.device)
        buffer = fusion.buffer
        arrived, fusion.arrived = fusion.arrived, {}
        with torch.no_grad():
            for s, (lo, hi) in zip(fusion.members, fusion.bounds, strict=True):
                buffer[lo:hi].copy_(arrived[id(s)].reshape(-1))
            if self._predivide != 1.0 and not self._engine_averages:
                buffer.div_(self._predivide)
        ready = None
        streams_for = getattr(self._backend, "streams_for", None)
        streams = streams_for(buffer) if streams_for is not None else None
        if streams is not None:
            ready = CudaTask(streams, streams.record_ready(buffer), self._divisor() if self._op == "average" else None)
        for s, (lo, hi) in zip(fusion.members, fusion.bounds, strict=True):
            s.grad = buffer[lo:hi].view_as(s.param)
            s.copy_back = None if self._cross else arrived[id(s)]
            s.cuda = ready
        self._note_submit(fusion.name, buffer)
        future = self._scheduler.submit(fusion.name, buffer, min(s.priority for s in fusion.members),
                                        on_done=None if self._engine_averages else self._after_reduce, ready=ready)
        self._tasks_submitted += 1
        for s in fusion.members:
            s.future = future
            s.landed, s.pieces = None, 0  # reduced alone last time (a partial group): not ranged now
            if s.split is not None:  # a plan that fused a split tied weight: its rows go as in _submit
                s.split.arm()

    def _checks_order(self, config: SchedulerConfig) -> bool:
        """Whether, under ``config``, each step ends with the ranks checking that they reduced the same
        tensors in the same order (:mod:`commsched.order_check`): ``verify_order`` and ``fifo`` (the
        other orderings agree on the order; torch's reducer submits nothing), an engine that pairs
        collectives by position (not Horovod, which matches them by name), more than one rank, and
        gradients in host memory (the CUDA path, which has not run on a GPU yet, is left out)."""
        return (config.verify_order and config.ordering == "fifo" and self.world_size > 1
                and not self._backend.negotiates_order and not any(s.param.is_cuda for s in self._params))

    def _note_submit(self, name: str, buffer: torch.Tensor) -> None:
        """A task goes to the scheduler: its place in this step's order, for the check at the step's end."""
        if self._verifying:
            self._manifest.add(name, buffer.numel(), str(buffer.dtype).removeprefix("torch."))

    def _submit_order_check(self) -> None:
        """At the end of a step (before ``mark_step``): under :meth:`_checks_order`, reduce this step's digest
        behind its pieces; :meth:`_order_checked` compares the sum when it lands."""
        entries = self._manifest.take()
        if not entries or not self._verifying:
            return
        own = digest_values(entries)
        step = self._steps
        self._order_checks += 1
        self._scheduler.submit(f"{CHECK_PREFIX}{step}", torch.tensor(own, dtype=torch.float64),
                               priority=len(self._params),
                               on_done=functools.partial(self._order_checked, step, entries, own))

    def _order_checked(self, step: int, entries: list[str], own: tuple[float, ...], task: Task) -> None:
        """Completion thread: the check of ``step`` landed. Equal on every rank: nothing. Otherwise raise
        ``OrderAgreementError`` (the scheduler fails and tells the other ranks), naming the first tensor
        that differs from rank 0's (rank 0: from rank 1's) where the store carries both lists."""
        if agree(task.tensor.tolist(), own, self.world_size):
            return
        other = 1 if self.rank == 0 else 0
        theirs = None
        if self._store is not None:
            key = f"{self._prefix}/order-check/{step}/"
            try:
                self._store.set(key + str(self.rank), "\n".join(entries).encode())
                theirs = split_lists(self._store.get(key + str(other), timeout_s=min(10.0, self.config.timeout_s)))
            except Exception as exc:  # noqa: BLE001 - the disagreement is the error; the names are a help
                log.warning("the other rank's list of step %d did not arrive: %r", step, exc)
        raise mismatch(step, self.rank, entries, other, theirs)

    def _divisor(self) -> float:
        """What the sum is divided by for an average (Horovod's predivide already took ``f``)."""
        return self.world_size / self._predivide if self._predivide != 1.0 else float(self.world_size)

    def _after_reduce(self, task: Task) -> None:
        # Completion thread: average. The tensor is owned by us (cross-iteration) or
        # not read by the user before synchronize() (synchronous path). On the CUDA
        # stream/event path the division is on the communication stream already; an engine
        # that averages itself (Horovod) submits with on_done=None and never gets here.
        if isinstance(task.ready, CudaTask):
            return
        if self._op == "average":
            task.tensor.div_(self._divisor())

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

    def _make_checkpoint_hook(self, states: list[_ParamState]) -> Callable:
        """A state-dict pre-hook (save and load) for one module: apply the updates of ``states`` whose
        step ended (``step()`` was called), waiting for their reductions. Without it, cross-iteration,
        ``torch.save(model.state_dict())`` would miss the last step's update, and a rank that loads a
        checkpoint would apply its own pending update on top of the loaded parameters (twice, since the
        saving rank's checkpoint has it). Gradients of a step not ended yet stay pending, as DDP's
        parameters are not updated before ``step()`` either."""
        def hook(module: torch.nn.Module, *args: Any) -> None:
            if self._closed or not self._cross:
                return
            ended = [s for s in states if s.future is not None and s.hyper is not None]
            if ended:
                self._ready(ended, "state_dict")
        return hook

    def _root_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self._reducer is not None and self._sync_enabled and torch.is_grad_enabled():
            self._reducer.before_forward()  # as DDP's forward: arm its hooks for this forward's backward
            self._backward_seen = True  # (no gradient hook of ours runs under the reducer to say so)
        if self._orphans:
            self._ready(self._orphans, "forward")

    def _ready(self, states: list[_ParamState], where: str) -> None:
        """Wait for ``states``' reductions and apply their updates (user's thread).

        The first call of a forward after a cross-iteration ``step()`` also takes every other
        parameter of a lean group whose update is due (its step ended) and whose reduction is done
        already: their updates join the same call of the optimizer class per param group, one call
        where each layer's pre-hook would make one each (where communication finished within
        backward, one call a step, as the wrapped optimizer's own ``step()``). Applying a due update
        before its layer's forward changes no value (no forward reads the parameter in between)."""
        pending = [s for s in states if s.future is not None]
        if self._sweep and where == "forward":
            self._sweep = False
            mine = {id(s) for s in pending}
            pending += [s for s in self._params if id(s) not in mine and s.future is not None and s.hyper is not None
                        and s.cuda is None and s.future.done() and self._lean_group(s.group)
                        and (s.split is None or s.split.done())]
        if not pending:
            return
        started = time.perf_counter()
        t0 = now_us()
        applying = 0.0  # of the time below, the ranged updates' (not a wait)
        for s in pending:
            if s.cuda is not None:
                self._wait_queued(s)  # CUDA: the CPU waits only until the pieces are on the stream
            elif where == "forward" and s.landed is not None and not s.future.done() and self._ranged_now(s):
                applying += self._apply_as_landed(s)  # and sets s.future to None: not in the batches below
            else:
                self._scheduler.wait(s.future)
        waited = time.perf_counter() - started - applying
        self._bubble += waited
        if waited > 0 and self.timeline.enabled:
            self.timeline.span("WAIT", f"{where}: {pending[0].name}", t0, now_us())
        for s in pending:
            if s.cuda is not None:
                self._wait_on_gpu(s)
            if s.split is not None and s.split.pending():  # the lookup's rows, onto the averaged dense part
                rows_from = time.perf_counter()
                s.split.add_into(s.grad)
                self._bubble += time.perf_counter() - rows_from
        if not self._cross:
            for s in pending:
                self._land(s)
            return
        batches: dict[tuple[int, int], list[_ParamState]] = {}
        for s in pending:
            if s.future is None:  # applied range by range already
                continue
            key = (id(s.group), id(s.hyper)) if self._lean_group(s.group) else (id(s), 0)
            batches.setdefault(key, []).append(s)
        for batch in batches.values():
            self._update(batch)

    def _lean_group(self, group: dict) -> bool:
        """Whether the parameters of ``group`` may be updated together, in one call of the user's
        optimizer class (lean apply), rather than one call each. Only where that is bitwise equal to
        one call over all parameters (the reference): the element-wise ``torch.optim`` classes of
        :data:`LEAN_APPLY`, exactly (a subclass may couple parameters), on CPU (measured bitwise for
        foreach off, on and fused: tests/plugin_torch/test_lean_apply.py), and on other devices only on
        the single-tensor path (``foreach=False``, not fused), whose loop is per parameter anyway."""
        found = self._lean_cache.get(id(group))
        if found is None:
            cpu = all(p.device.type == "cpu" for p in group["params"])
            found = self._lean and type(self.optimizer) in LEAN_APPLY and (
                cpu or (group.get("foreach") is False and not group.get("fused")))
            self._lean_cache[id(group)] = found
        return found

    def _ranged_now(self, state: _ParamState) -> bool:
        """Whether the optimizer's state for ``state``'s parameter lets one range be updated alone: every
        tensor in it has the parameter's shape (sliced like it) or none (a step count: each range
        advances its own copy, the last is kept); none at all only for momentum-free SGD, which keeps
        none (others create theirs at the first update: that one is applied whole)."""
        full = self.optimizer.state.get(state.param)
        if not full:
            group = state.hyper if state.hyper is not None else state.group
            return type(self.optimizer) is torch.optim.SGD and not group.get("momentum")
        return all(not torch.is_tensor(v) or v.dim() == 0 or (v.shape == state.param.shape and v.is_contiguous())
                   for v in full.values())

    def _apply_as_landed(self, state: _ParamState) -> float:
        """A forward waits for ``state``'s gradient: update each range of the parameter as its piece lands
        (averaged by :meth:`_piece_landed`) rather than all after the last one, so only the last range's
        update is left when the reduction ends. Bitwise equal to the update of the whole: the classes of
        :data:`LEAN_APPLY` are element-wise. Returns the seconds spent updating. Raises the reduction's
        error, or :class:`CommschedTimeout` after ``timeout_s``; a failed reduction may leave the ranges
        that landed before it updated (the run stops with the error)."""
        limit = self.config.timeout_s
        deadline = time.monotonic() + limit
        next_check = time.monotonic() + _ISSUE_POLL_S
        done, spent, last = 0, 0.0, None
        while done < state.pieces:  # then the future resolves as soon as the completion thread gets to it
            with self._landed_cv:
                finished = state.future.done()  # read first: every range has landed once it is done
                fresh = state.landed[done:]
                if not fresh and not finished:
                    self._landed_cv.wait(min(_ISSUE_POLL_S, max(0.0, deadline - time.monotonic())))
                    fresh = state.landed[done:]
            if not fresh:
                if finished:
                    break
                # Woken by another gradient's piece (one condition for all), or the poll: only the poll
                # looks for failures, since that is a store lookup across the network the pieces load.
                now = time.monotonic()
                if now >= next_check:
                    self._scheduler.check()
                    next_check = now + _ISSUE_POLL_S
                if now >= deadline:
                    raise CommschedTimeout(f"reducing {state.name!r}", limit, self._scheduler.pending())
                continue
            t = time.perf_counter()
            for lo, hi in _merged(fresh):
                last = self._update_range(state, lo, hi)
            spent += time.perf_counter() - t
            done += len(fresh)
        self._scheduler.wait(state.future)  # the reduction's error, if it failed
        full = self.optimizer.state.get(state.param)
        if last is not None and full:  # what each range advanced alone (a step count): once, for the parameter
            for k, v in last.items():
                if torch.is_tensor(v) and v.dim() == 0 and torch.is_tensor(full.get(k)):
                    full[k].copy_(v)
                elif not torch.is_tensor(v):
                    full[k] = v
        state.future = state.hyper = state.grad = state.landed = None
        self._ranged_counts["updates"] += 1
        self._ranged_counts["ranges"] += done
        return spent

    def _update_range(self, state: _ParamState, lo: int, hi: int) -> dict:
        """One call of the user's optimizer class over elements ``[lo, hi)`` of ``state``'s parameter, its
        averaged gradient and the matching slices of its optimizer state (views: updated in place);
        returns the range's state after the call."""
        t0 = now_us()
        key = (-1, id(state.group))
        sub = self._subs.get(key)
        if sub is None:
            sub = self._subs[key] = type(self.optimizer)([dict(state.group)])
        group = sub.param_groups[0]
        for k, value in (state.hyper if state.hyper is not None else state.group).items():
            if k != "params":
                group[k] = value
        view = state.param.detach().view(-1)[lo:hi]
        full = self.optimizer.state.get(state.param, {})
        ranged = {k: (v.view(-1)[lo:hi] if v.dim() else v.clone()) if torch.is_tensor(v) else v
                  for k, v in full.items()}
        sub.state = collections.defaultdict(dict)
        sub.state[view] = ranged
        group["params"] = [view]
        view.grad = state.grad.view(-1)[lo:hi]
        try:
            sub.step()
        finally:
            view.grad = None
        after = sub.state[view]
        for k, v in full.items():  # a class that replaced a tensor rather than updating it in place
            if torch.is_tensor(v) and v.dim() and after.get(k) is not ranged[k]:
                v.view(-1)[lo:hi].copy_(after[k])
        if self.timeline.enabled:
            self.timeline.span("UPDATE", f"{state.name}[{lo}:{hi}]", t0, now_us())
        return after

    def _wait_queued(self, state: _ParamState) -> None:
        """Block until every piece of ``state``'s gradient and its division are queued on the
        communication stream (credit may hold some back), at most ``timeout_s``; raises the
        scheduler's error if the reduction failed."""
        limit = self.config.timeout_s
        deadline = time.monotonic() + limit
        while not state.cuda.wait_issued(min(_ISSUE_POLL_S, max(0.0, deadline - time.monotonic()))):
            if state.future.done():  # failed (raises here), or a zero-size tensor with no piece to queue
                self._scheduler.wait(state.future)
                return
            self._scheduler.check()
            if time.monotonic() >= deadline:
                raise CommschedTimeout(f"queueing the reduction of {state.name!r}", limit, self._scheduler.pending())

    def _wait_on_gpu(self, state: _ParamState) -> None:
        """Order the compute stream after ``state``'s reduced gradient (no CPU block), and keep a
        timing event at this point so the GPU's stall counts in the bubble."""
        record, state.cuda = state.cuda, None
        if record.done_event is None:  # nothing was reduced (a zero-size tensor)
            return
        streams = record.streams
        stream = streams.current_stream(state.param.device)
        needed = streams.mark(stream)
        streams.wait_event(stream, record.done_event)
        self._gpu_waits.append((self._steps, streams, needed, record.done_event))

    def _account_gpu_waits(self, block: bool) -> None:
        """Add the GPU stalls (timing events) of ended steps to their ``bubble_s``; without ``block``
        only those whose events completed already (never a CPU wait in the training loop)."""
        keep = []
        for step, streams, needed, done in self._gpu_waits:
            if step >= self._steps or (not block and not (streams.is_done(needed) and streams.is_done(done))):
                keep.append((step, streams, needed, done))
                continue
            needed.synchronize()
            done.synchronize()
            index = len(self._bubbles) - (self._steps - step)
            if index >= 0:
                self._bubbles[index] += streams.elapsed_s(needed, done)
        self._gpu_waits = keep

    def _land(self, state: _ParamState) -> None:
        """Synchronous path: the averaged gradient is in ``p.grad`` (copied back if it was not contiguous)."""
        state.future = None
        grad, state.grad = state.grad, None
        if state.copy_back is not None:
            state.copy_back.copy_(grad)
        state.copy_back = None

    def _update(self, batch: list[_ParamState]) -> None:
        """Apply the reduced gradients of ``batch`` (one parameter, or a lean-apply batch of one param
        group and one step) with one call of the user's optimizer class, on the user's thread."""
        t0 = now_us()
        first = batch[0]
        key = (id(first.group),) if self._lean_group(first.group) else tuple(id(s.param) for s in batch)
        sub = self._subs.get(key)
        if sub is None:
            sub = self._subs[key] = type(self.optimizer)([dict(first.group)])
            sub.state = self.optimizer.state  # one state, the wrapped optimizer's
        group = sub.param_groups[0]
        hyper = first.hyper
        # The hyperparameters of the step these gradients belong to (an LR scheduler
        # may have moved on since), else the group's current ones.
        for k, value in (hyper if hyper is not None else first.group).items():
            if k != "params":
                group[k] = value
        group["params"] = [s.param for s in batch]
        for s in batch:
            s.future = None
            s.hyper = None
            s.landed, s.pieces = None, 0  # applied whole: its ranges are done with
            s.param.grad, s.grad = s.grad, None
        try:
            sub.step()
        finally:
            for s in batch:
                s.param.grad = None
        if self.timeline.enabled:
            self.timeline.span("UPDATE", first.name if len(batch) == 1 else f"{first.name} +{len(batch) - 1}",
                               t0, now_us())

    # -------------------------------------------------------------- user API
    #: ``GradScaler.step(opt)`` calls ``opt.step(grad_scaler=scaler)`` instead of unscaling ``p.grad``
    #: itself, which would read gradients still being reduced (or None, cross-iteration).
    _step_supports_amp_scaling = True

    def step(self, closure: Optional[Callable[[], float]] = None,
             grad_scaler: Optional["torch.amp.GradScaler"] = None) -> Optional[float]:
        """End the step. Cross-iteration: returns at once (updates happen in the next
        forward or in :meth:`synchronize`). Synchronous: waits for the reductions and
        runs the wrapped optimizer's ``step(closure)``.

        ``grad_scaler`` is passed by ``scaler.step(opt)`` (AMP): on the synchronous path the
        averaged gradients are unscaled and checked for inf/NaN (``scaler.unscale_``) and the
        update is skipped if any is found, as ``scaler.step`` does; cross-iteration refuses it
        (``ValueError`` naming the alternative)."""
        self._check_open()
        if grad_scaler is not None and self._cross:
            raise ValueError(_AMP_CROSS_ITERATION)
        if self._cross and closure is not None:
            raise ValueError("step(closure) needs all gradients at once; create the DistributedOptimizer with "
                             "SchedulerConfig(cross_iteration=False) to use a closure")
        if not self._backward_seen and not any(s.future is not None for s in self._params):
            # No backward since the last step, so no gradient of this step is ours:
            # hvd.broadcast_optimizer_state sets zero gradients and calls step() to
            # create a fresh optimizer's state. Run the wrapped optimizer's own step on
            # whatever p.grad holds, locally, and do not count it as a training step.
            return self.optimizer.step(closure)
        self._backward_seen = False
        if self._reducer is not None:
            self._reducer.check_finished()  # every bucket reduced and averaged into p.grad, or a clear error
        elif self._hooked < len(self._params):
            self._every_grad = False  # a parameter without a gradient this step: torch's reducer cannot run here
        self._hooked = 0
        loss = None
        for fusion in self._fusions:
            if fusion.arrived and not fusion.strict:
                # Only some members got a gradient this step (a branch not taken): reduce those one by
                # one, as without fusion; every rank that took the same branches submits the same tasks.
                arrived, fusion.arrived = fusion.arrived, {}
                for member in fusion.members:
                    if id(member) in arrived:
                        self._submit_alone(member, arrived[id(member)])
        partial = [f for f in self._fusions if f.arrived]
        if partial:
            raise CommschedError(
                f"step() ended a step in which fusion group {partial[0].name!r} got gradients for only part of its "
                f"parameters ({partial[0].missing()[:5]} had none); every parameter of a planned group must get a "
                "gradient every step, on every rank (use ordering='dynamic' for models with unused parameters)")
        for s in self._split_states:
            if s.split.pending() and s.future is None and self._sync_enabled:
                # a tied embedding whose projection did not run this step: its dense part is zero
                zeros = torch.zeros_like(s.param)
                if not self._cross:
                    s.param.grad = zeros
                self._submit_alone(s, zeros)
            if self._sync_enabled:
                s.split.flush()  # rows the synchronizing pass did not send (its lookup did not run after the arm)
        if self._recording:
            self._finish_recording()
        self._submit_order_check()
        self._scheduler.mark_step()
        if not self._cross:
            if grad_scaler is not None and _scaler_stage(grad_scaler, self) == "UNSCALED" and \
                    any(s.future is not None for s in self._params):
                raise CommschedError("scaler.unscale_(opt) ran while the gradients were still being reduced (it "
                                     "read unreduced p.grad); call opt.synchronize() before scaler.unscale_(opt)")
            self._ready(self._params, "step")  # waits (counted as bubble) and lands averaged grads in p.grad
            loss = self.optimizer.step(closure) if grad_scaler is None else self._scaled_update(grad_scaler)
            if self._requested.cross_iteration:
                # auto's tuner chose this path for a user who asked for cross-iteration, where p.grad is None
                # after every step: so it stays (a loop that never zeroes p.grad would sum two steps' gradients)
                for s in self._params:
                    s.param.grad = None
        else:
            snapshots = {id(g): {k: v for k, v in g.items() if k != "params"} for g in self.param_groups}
            for s in self._params:
                if s.future is not None and s.hyper is None:
                    s.hyper = snapshots[id(s.group)]
            self._sweep = self._lean
        self._steps += 1
        if self._adaptive or self._engine_switch:
            self._at_boundary(self._steps - 1)
        if self._slack and self._steps == self._slack["at_step"]:
            self._rank_by_slack()
        self._bubbles.append(self._bubble)
        if len(self._bubbles) > _BUBBLE_HISTORY:
            del self._bubbles[: len(self._bubbles) - _BUBBLE_HISTORY]
        self._bubble = 0.0
        if self._gpu_waits:
            self._account_gpu_waits(block=False)
        return loss

    def _scaled_update(self, scaler: "torch.amp.GradScaler") -> Optional[float]:
        """``scaler.step`` on the averaged gradients: unscale and check them (unless the user's
        ``scaler.unscale_(opt)`` did), then the wrapped optimizer's step unless one was inf/NaN."""
        if _scaler_stage(scaler, self) != "UNSCALED":
            scaler.unscale_(self)  # our param_groups are the wrapped optimizer's: p.grad holds the average
        found = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        if sum(float(v.item()) for v in found.values()):
            return None
        return self.optimizer.step()

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

    def exclude_pause(self) -> None:
        """Call after a pause in training (an evaluation, a checkpoint, another model's steps), before the next
        step: ``ordering="auto"``'s tuner scores a setting by the period from one step's end to the next, and
        the time since the last step is not one (it would read as one slow step, or as a drift to re-tune for).
        The next step's period is not scored; nothing else changes. A no-op for the other orderings."""
        self._last_step_end = None

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
        for sub in self._subs.values():
            sub.state = self.optimizer.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initializing", False):
            return super().add_param_group(param_group)
        raise NotImplementedError("add parameter groups to the optimizer before wrapping it in DistributedOptimizer")

    def stats(self) -> dict[str, Any]:
        """Per-step bubble time (seconds the forward or ``step()`` blocked on communication,
        most recent steps last), totals, and the scheduler's counters (pieces, bytes, order).

        With ``ordering="auto"`` (or ``"planned"`` without a plan) ``ordering`` is the one in use
        now, ``requested_ordering`` the config's, the scheduler's ``per_step`` and ``issue_times`` are
        numbered by optimizer step, and ``tuner`` has every decision taken (``switches``, on every rank) and,
        on rank 0 of ``auto``, the tuner's phase, incumbent and sample history. Where pieces run the
        two-level all-reduce (a plan's ``hierarchical`` pieces on torch.distributed), ``hierarchical``
        has its three phases' times on this rank
        (:meth:`commsched.plugins.torch.hierarchical.HierarchicalAllReduce.phase_stats`)."""
        sched = self._scheduler.stats()
        if self._sched_base_step:  # both by optimizer step: a reader pairs a step's order with its issue times
            for key in ("per_step", "issue_times"):
                sched[key] = {k + self._sched_base_step: v for k, v in sched[key].items()}
        if self._gpu_waits:
            self._account_gpu_waits(block=True)
        adaptive = {}
        if self._adaptive or self._engine_switch:
            adaptive = {"requested_ordering": self._requested.ordering,
                        "tuner": dict(self._tuner.stats() if self._tuner is not None else {},
                                      role="decides" if self.rank == 0 else "follows",
                                      switches=list(self._switches), next_decision=self._next_decision,
                                      pending_decision=self._pending_decision, model=list(self._auto_notes),
                                      settings={k: self.config.__dict__[k] for k in (
                                          "ordering", "partition_bytes", "credit_bytes", "fusion_bytes",
                                          "cross_iteration", "direct_start")})}
        two_level = getattr(self._backend, "hierarchical", None)
        two_level = two_level if two_level is not None and not getattr(two_level, "flat", True) else None
        return {
            "steps": self._steps,
            "bubble_s": list(self._bubbles),
            "bubble_total_s": float(sum(self._bubbles)),
            "pieces": sched["pieces"] + sum(r["pieces"] for r in self._retired),
            "bytes": sched["bytes"] + sum(r["bytes"] for r in self._retired),
            "cross_iteration": self._cross,
            "ordering": self.config.ordering,
            # "torch-reducer": torch's own C++ reducer (DDP's) reduces every gradient; commsched schedules none
            "engine": "commsched" if self._reducer is None else "torch-reducer",
            **({"reducer": {"bucket_bytes": self._reducer.bucket_bytes, "backwards": self._reducer.armed}}
               if self._reducer is not None else {}),
            **adaptive,
            "priorities": {s.name: s.priority for s in sorted(self._params, key=lambda s: s.priority)},
            **({"slack": dict(self._slack, alpha=self.config.slack_alpha)} if self._slack else {}),
            "fusion_bytes": self.config.fusion_bytes,
            "fused": {f.name: [m.name for m in f.members] for f in self._fusions},
            "order_checks": self._order_checks,  # steps whose order the ranks checked (verify_order, fifo)
            # a forward waited for these gradients and updated each range as its piece landed
            "ranged_apply": dict(self._ranged_counts),
            # split_tied_embeddings: per tied embedding, the row exchanges done and the rows they carried
            "tied_embeddings": {s.split.name: s.split.stats() for s in self._split_states},
            "scheduler": sched,
            # the two-level all-reduce's phases on this rank (where its pieces' time goes)
            **({"hierarchical": two_level.phase_stats()} if two_level is not None else {}),
            **({"plan": {"digest": self.plan.digest, "groups": len(self.plan.groups), "pieces": len(self.plan.pieces),
                         "fused_groups": len(self._fusions), "credit_bytes": self.plan.credit_bytes,
                         "nodes": self.plan.nodes, "ranks_per_node": self.plan.ranks_per_node,
                         "predicted": dict(self.plan.predicted)}} if self.plan is not None else {}),
        }

    def profile(self) -> Profile:
        """A :class:`commsched.costmodel.Profile` of the last recorded steps of this training (up to
        8): per-layer forward, backward, ready and apply times, gradient tensors by their names here.
        See :func:`commsched.plugins.torch.profiler.profile_recorded` for what each time is."""
        recorder = getattr(self, "_recorder", None)
        if recorder is None:
            raise ValueError("profile() needs the model: create the DistributedOptimizer with model=... "
                             "(without it there are no layers to time)")
        prof = profile_recorded(recorder, cross_iteration=self._cross, world_size=self.world_size)
        # the tensors this training may update range by range (CPU only: CUDA divides on its stream), for the simulator
        known = set(prof.tensor_names())
        prof = dataclasses.replace(prof, ranged=tuple(
            s.name for s in self._params if s.name in known and s.param.device.type == "cpu"
            and self._may_range(s) and self._ranged_now(s)))
        if self._split_states:  # measured with the split on: its readiness is already the split's
            prof = dataclasses.replace(prof, meta=dict(prof.meta, tied_split=[s.name for s in self._split_states]))
        return prof

    def report(self, topology: Any = None) -> str:
        """A short summary of the training so far: exposed communication per step, bytes and pieces
        per step, goodput, the settings in use; with ``topology`` (a
        :class:`commsched.costmodel.Topology`, e.g. from ``commsched probe``) also the time the
        network should take, the overlap that implies and the step the simulator expected.
        Returns the text (print it, or log it)."""
        from commsched.costmodel.report import format_report, training_report

        try:
            prof = self.profile()
        except ValueError:  # no model: no layers to time
            prof = None
        settings = {"ordering": self.config.ordering, "partition_bytes": self.config.partition_bytes,
                    "credit_bytes": self.config.credit_bytes, "fusion_bytes": self.config.fusion_bytes,
                    "cross_iteration": self._cross, "world_size": self.world_size}
        return format_report(training_report(self.stats(), settings=settings, profile=prof, topology=topology))

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
            self._remove_path_hooks()
            self._close_reducer(resume=False)
            self._close_splits()
            if self._tuner is not None:
                self._tuner.close()  # its progress bar, on rank 0's terminal
            self._scheduler.close(timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise SchedulerClosed("this DistributedOptimizer is closed; create a new one to train further")

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({self.optimizer!r}, ordering={self.config.ordering!r}, "
                f"world_size={self.world_size})")
