"""Measure a :class:`commsched.costmodel.Profile` of a PyTorch training step.

Three entry points:

* :func:`profile_model` — time a model's steps in this process (tests, notebooks);
* :func:`load_or_profile` / ``commsched profile`` — profile a benchmark workload the
  way ``commsched bench`` runs it: on the same emulated cluster, every rank computing
  at once, with the bench's own baseline phase run first; cached per workload, batch
  size, cluster flags and machine (what ``commsched simulate --workload W`` reads);
* ``DistributedOptimizer.profile()`` — the recorded steps of a user's own training
  (:class:`StepRecorder`, always on, a bounded ring of the last steps).

What a layer is, and how its times are cut (the same in all three):

* a *layer* is a module that owns parameters (``recurse=False``), in the order of
  its first forward pre-hook: the order DistributedOptimizer gives its priorities.
  A parameter belongs to the first layer that uses it (tied weights: once). Its
  tensors carry the names of ``model.named_parameters()``, as the scheduler gets them.
* ``forward_s`` of layer *i* is the time from the end of its pre-hook (where
  DistributedOptimizer waits for and applies its parameters) to the start of layer
  *i+1*'s pre-hook; the last layer's runs to the end of forward (:func:`profile_model`
  and the workload profile: to the loss, as the bench times forward). So the code
  between layers (activations, reshapes) counts where a cross-iteration step runs it.
* ``ready_s``: from the start of backward to the last post-accumulate-grad hook of
  the layer's tensors. ``backward_s`` of a layer is the time from the previous ready
  layer (in reverse forward order) to its own readiness, so the backward times add up
  to the last ready time and ``ready_s`` is their running sum.
* ``apply_s``: the user's optimizer class applied to the layer's parameters one
  parameter at a time, as DistributedOptimizer applies them (one instance per
  parameter sharing the wrapped optimizer's ``state``).
* everything else of the step (``zero_grad``, code before the first layer, the end of
  backward after the last gradient) is ``step_overhead_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from commsched.costmodel.profile import (
    TWO_LEVEL_PHASES,
    LayerProfile,
    Profile,
    TensorSpec,
    handoff_from_times,
    link_excess_from_times,
    piece_cost_fit,
    pooled_start_skew,
    steal_share,
    two_level_phase_fit,
    two_level_phase_steps,
)

__all__ = ["StepRecorder", "add_arguments", "cache_path", "load_or_profile", "machine_fingerprint",
           "profile_model", "profile_workload", "run"]

log = logging.getLogger(__name__)

#: Steps kept by :class:`StepRecorder` (the last ones are what ``opt.profile()`` describes).
RECORDED_STEPS = 8
#: Default cache of workload profiles.
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "commsched" / "profiles"
#: Bump when what a cached profile means changes: older cache entries are then ignored
#: (2: ``per_piece_steal_s`` measured; 3: ``tied`` names the tied embedding weights; 4: ``handoff_s`` measured;
#: 5: ``per_grad_hook_s`` measured; 6: ``comm_contention`` from the all-reduce's own end, not work.wait()'s;
#: 7: ``per_piece_link_s`` measured; 8: ``per_task_submit_s`` split from ``per_grad_hook_s``; 9: ``per_piece_link_s``
#: the slope over two piece sizes; 10: ``two_level_phases`` measured on several nodes of several ranks; 11: the
#: ``dynamic`` runs measured with ``decide_ahead``, rank 0 publishing an ended step's rest at once; 12:
#: ``two_level_skew_s``, the two-level runs' start skew, charged to two-level pieces; 13: a fit of
#: ``per_piece_link_s`` whose stretch of the bytes is at 0 or below falls back to one run's excess; 14:
#: ``contention`` from compute beside a stream of all-reduces that outlasts it, where one all-reduce ended first;
#: 15: ``per_piece_steal_s`` counts the piece completions on gloo's threads too, the plugin's ``on_piece`` included).
CACHE_VERSION = 15
#: Steps of ``dynamic`` the profile runs to measure commsched's thread CPU per piece (after 2 unmeasured).
SCHED_CPU_STEPS = 5
#: Steps of ``dynamic`` with one piece in flight whose hand-offs the profile measures (after 2
#: unmeasured; the scheduler keeps the issue times of its last 3 steps).
HANDOFF_STEPS = 3
#: Steps of ``dynamic`` with pieces of the run's piece size / :data:`SMALL_PIECES_DIVISOR` (at least
#: :data:`SMALL_PIECES_MIN_BYTES`) whose network time, against the ``sched_cpu`` run's, gives the cost of
#: a piece (after 2 unmeasured; the scheduler keeps the issue times of its last 3 steps).
SMALL_PIECES_STEPS = 3
SMALL_PIECES_DIVISOR = 4
SMALL_PIECES_MIN_BYTES = 64 << 10
#: Steps of ``dynamic`` with every piece two-level (several nodes of several ranks only), once with the
#: run's piece size and once with pieces :data:`TWO_LEVEL_LARGE` times as large, both under a credit of
#: four of the large pieces (the pipeline's phases overlap as a plan's do): their phases' busy times give
#: ``Profile.two_level_phases`` (after 2 unmeasured; the scheduler keeps the issue times of its last 3 steps).
TWO_LEVEL_STEPS = 3
TWO_LEVEL_LARGE = 4


# ----------------------------------------------------------------------------- recording
@dataclass
class _Pass:
    """Timestamps (perf_counter seconds) of one forward + backward."""

    start: float
    layer_in: dict[int, float] = field(default_factory=dict)   # layer -> its first pre-hook begins
    layer_out: dict[int, float] = field(default_factory=dict)  # layer -> after the optimizer's pre-hook
    waited: dict[int, float] = field(default_factory=dict)     # layer -> wait (bubble) inside that pre-hook
    forward_end: float | None = None
    backward_start: float | None = None
    ready: dict[int, float] = field(default_factory=dict)      # layer -> its last gradient accumulated
    apply_whole_s: float | None = None                         # the wrapped optimizer's own step()
    step_wait_s: float = 0.0                                   # waits in step() (synchronous path)
    backward_end: float | None = None                          # loss.backward() returned (when known)
    hook: dict[int, float] = field(default_factory=dict)       # layer -> seconds in commsched's gradient hooks
    hooks: int = 0                                             # gradient hooks timed in this pass
    task_hook_s: float = 0.0                                   # of them, those that submitted a task: seconds
    task_hooks: int = 0                                        # and calls
    end: float | None = None                                   # the next pass's start


class StepRecorder:
    """Hooks on ``model`` that time the layers of each forward and backward.

    ``params``: ``(name, parameter)`` pairs the profile names (the scheduler's names).
    ``waited``: a running counter of seconds blocked on communication (the
    optimizer's bubble) that the recorder reads before and after each pre-hook, so
    waiting is not counted as apply time. Keeps the last ``keep`` passes
    (a ring: memory and cost stay bounded however long training runs).

    Hook order, so that a layer's pre-hook interval brackets DistributedOptimizer's
    wait-and-apply: ``layer_in`` is a prepended pre-hook, ``layer_out`` a pre-hook
    registered after the optimizer's. Cost: four ``perf_counter`` calls and a few
    dict stores per layer and step, one per parameter in backward (see
    docs/simulator.md for the measured overhead).
    """

    def __init__(self, model: nn.Module, params: Sequence[tuple[str, torch.Tensor]], *,
                 waited: Callable[[], float] | None = None, optimizer: torch.optim.Optimizer | None = None,
                 keep: int = RECORDED_STEPS) -> None:
        self.model = model
        self.params = dict(params)
        self._names = {id(p): n for n, p in params}
        self._params = {id(p): p for _, p in params}
        self._waited = waited or (lambda: 0.0)
        self.passes: deque[_Pass] = deque(maxlen=keep)
        self._current: _Pass | None = None
        self._layer_of_module: dict[int, int] = {}     # id(module) -> layer index (fixed after the first pass)
        self.layers: list[tuple[str, list[str]]] = []  # (module name, tensor names) in forward order
        self._layer_of_param: dict[int, int] = {}
        self._claimed: set[int] = set()
        self._wait_mark = 0.0
        self.handles: list[Any] = []
        module_names = {id(m): n for n, m in model.named_modules()}
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in self._params]
            if own:
                name = module_names.get(id(module)) or type(module).__name__
                self.handles.append(module.register_forward_pre_hook(self._make_in(module, name, own),
                                                                     prepend=True))
                self.handles.append(module.register_forward_pre_hook(self._make_out(module)))
        for _, p in params:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._make_ready(p)))
        # Prepended last, so it runs before every other pre-hook (the root's own layer hook included).
        self.handles.append(model.register_forward_pre_hook(self._root_pre, prepend=True))
        self.handles.append(model.register_forward_hook(self._root_post))
        if optimizer is not None:  # the synchronous path's optimizer.step() of all parameters
            self.handles.append(optimizer.register_step_pre_hook(self._step_pre))
            self.handles.append(optimizer.register_step_post_hook(self._step_post))
        self._step_t0 = 0.0
        self.hook_s, self.hooks = 0.0, 0  # DistributedOptimizer's gradient hooks so far: wall seconds, calls
        self.task_hook_s, self.task_hooks = 0.0, 0  # of them, the hooks that submitted a task

    # hooks -----------------------------------------------------------------
    def _root_pre(self, _module: nn.Module, _args: Any) -> None:
        now = time.perf_counter()
        if self._current is not None:
            self._current.end = now
            self.passes.append(self._current)
        self._current = _Pass(start=now)

    def _root_post(self, _module: nn.Module, _args: Any, output: Any) -> None:
        cur = self._current
        if cur is None:
            return
        cur.forward_end = time.perf_counter()
        tensor = _first_grad_tensor(output)
        if tensor is not None and torch.is_grad_enabled():
            def started(grad: torch.Tensor) -> None:  # the gradient reached the model's output
                if cur.backward_start is None:
                    cur.backward_start = time.perf_counter()
            tensor.register_hook(started)

    def _make_in(self, module: nn.Module, name: str, own: list[torch.Tensor]) -> Callable:
        key = id(module)

        def hook(_module: nn.Module, _args: Any) -> None:
            cur = self._current
            if cur is None:
                return
            index = self._layer_of_module.get(key)
            if index is None:  # the first time this module runs: claim its unclaimed parameters
                fresh = [p for p in own if id(p) not in self._claimed]
                if not fresh:
                    return
                index = len(self.layers)
                self._layer_of_module[key] = index
                self.layers.append((name, [self._names[id(p)] for p in fresh]))
                for p in fresh:
                    self._claimed.add(id(p))
                    self._layer_of_param[id(p)] = index
            if index not in cur.layer_in:
                self._wait_mark = self._waited()
                cur.layer_in[index] = time.perf_counter()
        return hook

    def _make_out(self, module: nn.Module) -> Callable:
        key = id(module)

        def hook(_module: nn.Module, _args: Any) -> None:
            cur = self._current
            index = self._layer_of_module.get(key)
            if cur is None or index is None or index in cur.layer_out:
                return
            cur.layer_out[index] = time.perf_counter()
            cur.waited[index] = max(0.0, self._waited() - self._wait_mark)
        return hook

    def _make_ready(self, param: torch.Tensor) -> Callable:
        key = id(param)

        def hook(_p: torch.Tensor) -> None:
            cur = self._current
            index = self._layer_of_param.get(key)
            if cur is not None and index is not None:
                cur.ready[index] = time.perf_counter()
        return hook

    def hooked(self, param: torch.Tensor, seconds: float, submitted: bool = True) -> None:
        """DistributedOptimizer's gradient hook for ``param`` took ``seconds`` of the training thread
        (``profile()`` takes it out of the layer's backward: the cost model charges it apart;
        ``hook_s`` and ``hooks`` count every one, recorded pass or not; ``task_hook_s`` and
        ``task_hooks`` those that ``submitted`` a task, not only joined a fusion group)."""
        self.hook_s += seconds
        self.hooks += 1
        if submitted:
            self.task_hook_s += seconds
            self.task_hooks += 1
        cur = self._current
        index = self._layer_of_param.get(id(param))
        if cur is not None and index is not None:
            cur.hook[index] = cur.hook.get(index, 0.0) + seconds
            cur.hooks += 1
            if submitted:
                cur.task_hook_s += seconds
                cur.task_hooks += 1

    def _step_pre(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self._step_t0 = time.perf_counter()
        self.mark(step_wait_s=self._waited())

    def _step_post(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self.mark(apply_whole_s=time.perf_counter() - self._step_t0)

    # driven by the training loop or the optimizer's step hooks --------------
    def mark(self, **values: float) -> None:
        """Set fields of the current pass (``backward_start``, ``apply_whole_s``, ...)."""
        if self._current is not None:
            for key, value in values.items():
                setattr(self._current, key, value)

    def finish(self) -> None:
        """Close the current pass now (its ``end``), e.g. after the last step."""
        if self._current is not None:
            self._current.end = time.perf_counter()
            self.passes.append(self._current)
            self._current = None

    def remove(self) -> None:
        """Remove every hook."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def orphans(self) -> list[str]:
        """Parameter names no layer claimed (never used inside their own module's forward)."""
        return [n for pid, n in self._names.items() if pid not in self._claimed and self._params[pid].requires_grad]


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for item in values:
        found = _first_grad_tensor(item)
        if found is not None:
            return found
    return None


def _median(values: Iterable[float]) -> float:
    s = sorted(values)
    if not s:
        return 0.0
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@dataclass
class _Cut:
    """Per-layer medians of the passes, in forward order, before any scaling."""

    forward: list[float]
    backward: list[float]
    ready: list[float]
    waited: list[float]
    pre_forward: float        # root start -> first layer (code before the first layer)
    forward_total: float      # root start -> forward end
    backward_total: float     # backward start -> end of backward (or last gradient)
    step_total: float         # one pass start -> the next
    step_wait: float
    apply_whole: float | None
    passes: int
    hooks: float = 0.0                # commsched's gradient hooks a pass, taken out of the backward
    per_hook: float | None = None     # their time per gradient (None: none timed)
    # where some hooks only joined a fusion group: their time per gradient, and what a hook that
    # submitted a task took beyond that (None: not both kinds, per_hook is all there is)
    per_grad: float | None = None
    per_task: float | None = None


def _cut(passes: Sequence[_Pass], n: int, *, forward_end: str = "forward_end",
         backward_end: str | None = None) -> _Cut:
    """Cut each pass into layers (module docstring) and take per-layer medians."""
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    rdy: list[list[float]] = [[] for _ in range(n)]
    wt: list[list[float]] = [[] for _ in range(n)]
    pre, ftot, btot, stot, swait, whole = [], [], [], [], [], []
    hook_total: list[float] = []
    per_hook: list[float] = []
    split: list[tuple[float, float]] = []
    used = 0
    for p in passes:
        end_f = getattr(p, forward_end)
        if len(p.layer_in) < n or end_f is None or p.backward_start is None:
            continue  # a pass that did not run every layer (eval, partial) says nothing about the step
        used += 1
        for i in range(n):
            nxt = p.layer_in[i + 1] if i + 1 < n else end_f
            fwd[i].append(max(0.0, nxt - p.layer_out.get(i, p.layer_in[i])))
            wt[i].append(p.waited.get(i, 0.0))
        pre.append(p.layer_in[0] - p.start)
        ftot.append(end_f - p.start)
        # commsched's gradient hooks ran on this thread before each ready stamp: take each out of its
        # layer's backward and every later ready time (in the order the gradients came)
        ready, hooked = {}, 0.0
        for i in sorted(p.ready, key=p.ready.__getitem__):
            hooked += p.hook.get(i, 0.0)
            ready[i] = p.ready[i] - p.backward_start - hooked
        later = 0.0
        for i in range(n - 1, -1, -1):
            r = ready.get(i, later)
            rdy[i].append(max(r, later))
            bwd[i].append(max(0.0, r - later))
            later = max(later, r)
        b_end = getattr(p, backward_end) if backward_end else None
        btot.append((b_end - p.backward_start - hooked) if b_end is not None else later)
        hook_total.append(hooked)
        if p.hooks:
            per_hook.append(hooked / p.hooks)
            both = _hook_split(sum(p.hook.values()), p.hooks, p.task_hook_s, p.task_hooks)
            if both is not None:
                split.append(both)
        if p.end is not None:
            stot.append(p.end - p.start)
        swait.append(p.step_wait_s)
        if p.apply_whole_s is not None:
            whole.append(p.apply_whole_s)
    if not used:
        raise ValueError("no complete step was recorded (each needs a forward that ran every layer and a "
                         "backward); run a few training steps first")
    return _Cut([_median(v) for v in fwd], [_median(v) for v in bwd], [_median(v) for v in rdy],
                [_median(v) for v in wt], _median(pre), _median(ftot), _median(btot), _median(stot),
                _median(swait), _median(whole) if whole else None, used, _median(hook_total),
                _median(per_hook) if per_hook else None, _median([g for g, _ in split]) if split else None,
                _median([t for _, t in split]) if split else None)


def _scale(values: list[float], target: float, rest: float = 0.0) -> tuple[list[float], float]:
    """Scale ``values`` (and ``rest``) by one factor so that together they sum to ``target``."""
    total = sum(values) + rest
    factor = target / total if total > 0 else 1.0
    return [v * factor for v in values], factor


def _tensor_specs(names: Sequence[str], params: dict[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(n, params[n].numel(), params[n].element_size(), tuple(params[n].shape),
                            str(params[n].dtype).removeprefix("torch.")) for n in names)


# --------------------------------------------------------------------- apply per layer
def _per_parameter_optimizers(optimizer: torch.optim.Optimizer) -> dict[int, torch.optim.Optimizer]:
    """One instance of the user's optimizer class per parameter, sharing ``state``: how
    DistributedOptimizer applies a layer's update in the next forward."""
    subs = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            sub = type(optimizer)([{**group, "params": [p]}])
            sub.state = optimizer.state
            subs[id(p)] = sub
    return subs


def _time_apply(layers: Sequence[Sequence[torch.Tensor]], subs: dict[int, torch.optim.Optimizer]) -> list[float]:
    out = []
    for params in layers:
        t0 = time.perf_counter()
        for p in params:
            if p.grad is not None:
                subs[id(p)].step()
        out.append(time.perf_counter() - t0)
    return out


# ------------------------------------------------------------------------ one process
def profile_model(model: nn.Module, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                  optimizer: torch.optim.Optimizer, *, steps: int = 5, warmup: int = 1,
                  barrier: Callable[[], None] | None = None, source: str = "profile_model",
                  batch_size: int | None = None) -> Profile:
    """Time ``steps`` training steps (after ``warmup``) of ``model`` on ``(x, y)`` in this process.

    Each step is the bench's (``zero_grad``, forward + loss, ``backward``, ``step``);
    ``barrier`` (e.g. ``dist.barrier``) runs before each so that every rank of a group
    computes at once, as the bench's baseline does. Per-layer medians are scaled by one
    factor per phase so that forward (with the code before the first layer) sums to
    the median forward, backward (with its tail after the last gradient) to the median
    backward, and the per-parameter applies to the median ``optimizer.step()`` times
    the measured ratio per-parameter / whole: :attr:`Profile.compute_s` is the median
    step as a cross-iteration step runs it. ``meta`` has the unscaled medians.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    recorder = StepRecorder(model, named, keep=steps + warmup)
    phases: list[tuple[float, float, float]] = []
    wait = barrier or (lambda: None)
    try:
        for i in range(warmup + steps):
            wait()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            t1 = time.perf_counter()
            recorder.mark(forward_end=t1, backward_start=t1)
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            recorder.mark(backward_end=t2, apply_whole_s=t3 - t2)
            recorder.finish()
            recorder.passes[-1].start = t0  # the step starts at zero_grad, as the bench times it
            if i >= warmup:
                phases.append((t1 - t0, t2 - t1, t3 - t2))
        layer_params = {n: p for n, p in named}
        layers = list(recorder.layers)
        orphans = recorder.orphans()
        passes = list(recorder.passes)[warmup:]
        # Per-parameter applies, timed on the gradients of the last backward (left in p.grad).
        subs = _per_parameter_optimizers(optimizer)
        groups = [[layer_params[n] for n in names] for _, names in layers]
        apply_runs, whole_runs = [], []
        for _ in range(steps):
            wait()
            apply_runs.append(_time_apply(groups, subs))
            wait()
            t0 = time.perf_counter()
            optimizer.step()
            whole_runs.append(time.perf_counter() - t0)
    finally:
        recorder.remove()
        optimizer.zero_grad(set_to_none=True)
    if orphans:
        raise ValueError(f"parameters {orphans} are never used inside their own module's forward; "
                         "profile_model cannot place them in a layer")
    cut = _cut(passes, len(layers), backward_end="backward_end")
    unscaled = {"forward_s": cut.forward, "backward_s": cut.backward, "ready_s": cut.ready,
                "pre_forward_s": cut.pre_forward, "backward_tail_s": max(0.0, cut.backward_total - sum(cut.backward)),
                "apply_s": [_median(r[i] for r in apply_runs) for i in range(len(layers))],
                "optimizer_step_s": _median(whole_runs), "measured_steps": cut.passes}
    tensors = [_tensor_specs(names, layer_params) for _, names in layers]
    return _build([name for name, _ in layers], tensors, unscaled, source=source, batch_size=batch_size,
                  forward_s=_median(p[0] for p in phases), backward_s=_median(p[1] for p in phases),
                  optimizer_s=_median(p[2] for p in phases), tied=tied_tensor_names(model, named))


def tied_tensor_names(model: nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    """The names (as ``named`` gives them) of the tied embedding weights that
    ``split_tied_embeddings=True`` can split (:func:`commsched.plugins.torch.tied.find_tied_embeddings`);
    none where an embedding's options rule the split out."""
    from commsched.plugins.torch.tied import find_tied_embeddings

    try:
        ids = {id(module.weight) for _, module in find_tied_embeddings(model)}
    except ValueError:
        return ()
    return tuple(n for n, p in named if id(p) in ids)


def _build(names: list[str], tensors: list[tuple[TensorSpec, ...]], unscaled: dict[str, Any], *, source: str,
           batch_size: int | None, forward_s: float, backward_s: float, optimizer_s: float,
           contention: float = 1.0, comm_contention: float = 1.0, meta: dict | None = None,
           tied: Sequence[str] = ()) -> Profile:
    """The Profile: the ``unscaled`` per-layer medians scaled to the phase totals
    ``forward_s``/``backward_s``/``optimizer_s`` (module docstring of :func:`profile_model`)."""
    pre, bwd_tail = unscaled["pre_forward_s"], unscaled["backward_tail_s"]
    pre_and_fwd, f_factor = _scale(unscaled["forward_s"], forward_s, pre)
    bwd, b_factor = _scale(unscaled["backward_s"], backward_s, bwd_tail)
    whole_local = unscaled["optimizer_step_s"]
    a_factor = optimizer_s / whole_local if whole_local > 0 else 1.0
    applied = [a * a_factor for a in unscaled["apply_s"]]
    layers = names
    ready, later = [0.0] * len(layers), 0.0
    for i in range(len(layers) - 1, -1, -1):
        later += bwd[i]
        ready[i] = later
    overhead = pre * f_factor + bwd_tail * b_factor
    out = [LayerProfile(name=name, forward_s=pre_and_fwd[i], backward_s=bwd[i], apply_s=applied[i],
                        ready_s=ready[i], tensors=tensors[i]) for i, name in enumerate(layers)]
    info = {
        "scaling": ("per-layer medians x one factor per phase so they sum to the phase totals: "
                    "forward (+ code before the first layer) to forward_s, backward (+ tail after the last "
                    "gradient) to backward_s, per-parameter apply x optimizer_s / whole optimizer.step() "
                    "timed with it"),
        "scale_forward": f_factor, "scale_backward": b_factor, "scale_apply": a_factor,
        "forward_s": forward_s, "backward_s": backward_s,
        "optimizer_step_s": optimizer_s,  # the wrapped optimizer's own step() over all parameters
        "apply_per_parameter_s": sum(applied),  # the same update, one parameter at a time
        "measured_steps": unscaled["measured_steps"], "unscaled": unscaled,
    }
    info.update(meta or {})
    return Profile(layers=tuple(out), source=source, batch_size=batch_size, contention=contention,
                   comm_contention=comm_contention, step_overhead_s=overhead, optimizer_step_s=optimizer_s,
                   meta=info, tied=tuple(tied))


# ------------------------------------------------------------- DistributedOptimizer's
def profile_recorded(recorder: StepRecorder, *, cross_iteration: bool, world_size: int,
                     batch_size: int | None = None, source: str = "DistributedOptimizer.profile") -> Profile:
    """The profile of the passes ``recorder`` kept (``DistributedOptimizer.profile()``).

    Times are as training ran them, so they already include the slowdown by the
    communication that overlapped them (``contention`` is 1: it is in the numbers).
    Cross-iteration: ``apply_s`` is the time of each layer's pre-hook minus its wait
    (the optimizer's bubble); the first layer's holds the updates that were reduced by then (lean
    apply's sweep applies them there in one call), so the sum is the step's apply. Synchronous:
    the wrapped ``optimizer.step()`` of all parameters is split over the layers in proportion to
    their gradient bytes.
    ``step_overhead_s`` is the rest of the median step: loss, user code, waits are not in it
    (``meta['bubble_s']`` has them).
    """
    passes = [p for p in recorder.passes if p.end is not None]
    if len(passes) > 1:
        passes = passes[1:]  # the first recorded pass learns the order and has no update to apply
    layers = list(recorder.layers)
    if not layers:
        raise ValueError("no step was recorded yet; run a few training steps before profile()")
    params = recorder.params
    cut = _cut(passes, len(layers))
    sizes = [sum(params[n].numel() * params[n].element_size() for n in names) for _, names in layers]
    if cross_iteration:
        apply = []
        for i in range(len(layers)):
            spans = [p.layer_out[i] - p.layer_in[i] - p.waited.get(i, 0.0) for p in passes
                     if i in p.layer_out and i in p.layer_in]
            apply.append(max(0.0, _median(spans)))
        whole = sum(apply)
    else:
        whole = cut.apply_whole or 0.0
        apply = [whole * s / max(1, sum(sizes)) for s in sizes]
    bubble = sum(cut.waited) + cut.step_wait
    # the hooks are out of the backward (_cut) and not overhead either: the simulator adds them back
    # per gradient under commsched's strategies, and DDP's hook is its own (in C++)
    rest = cut.step_total - sum(cut.forward) - sum(cut.backward) - sum(apply) - bubble - cut.hooks
    out = []
    for i, (name, names) in enumerate(layers):
        out.append(LayerProfile(name=name, forward_s=cut.forward[i], backward_s=cut.backward[i], apply_s=apply[i],
                                ready_s=cut.ready[i], tensors=_tensor_specs(names, params)))
    per_grad, per_task = (cut.per_grad, cut.per_task) if cut.per_task is not None else (cut.per_hook or 0.0, 0.0)
    meta = {
        "cross_iteration": cross_iteration, "world_size": world_size, "measured_steps": cut.passes,
        "step_s": cut.step_total, "bubble_s": bubble, "wait_per_layer_s": cut.waited,
        "optimizer_step_s": whole, "orphans": recorder.orphans(),
        "grad_hook": {"value": per_grad, "per_task_submit_s": per_task, "per_step_s": cut.hooks,
                      "mean_per_gradient_s": cut.per_hook,
                      "how": "wall time of DistributedOptimizer's gradient hook, taken out of each layer's backward "
                             "and ready times; per gradient the median over the passes of the hooks that only "
                             "joined a fusion group, per task the excess of those that submitted one (the mean of "
                             "all hooks per gradient where no gradient was fused)"},
        "note": "times measured during training, under its communication: contention is included in them",
    }
    return Profile(layers=tuple(out), source=source, batch_size=batch_size, contention=1.0,
                   step_overhead_s=max(0.0, rest), optimizer_step_s=whole, meta=meta,
                   per_grad_hook_s=per_grad, per_task_submit_s=per_task,
                   tied=tied_tensor_names(recorder.model, list(params.items())))


# ------------------------------------------------------------------------- workloads
def machine_fingerprint() -> dict[str, Any]:
    """What a profile's times depend on besides the flags: CPU, cores, torch, commsched."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    from commsched._version import __version__
    return {"host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
            "commsched": __version__, "python": platform.python_version()}


def _cache_key(workload: str, batch_size: int | None, workers: int, nodes: int, bandwidth: str | None,
               intra_bandwidth: str | None, network: str, seed: int) -> dict[str, Any]:
    return {"version": CACHE_VERSION, "workload": workload, "batch_size": batch_size, "workers": workers,
            "nodes": nodes, "bandwidth": bandwidth, "intra_bandwidth": intra_bandwidth, "network": network,
            "seed": seed, "machine": machine_fingerprint()}


def cache_path(key: dict[str, Any], cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the profile of ``key`` is cached: ``<dir>/<workload>-<hash of the key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir or DEFAULT_CACHE_DIR) / f"{key['workload']}-{digest}.json"


def _norm_rate(text: str | None) -> str | None:
    from commsched.bench.netns import parse_rate
    return None if parse_rate(text) is None else text


def load_or_profile(workload: str, *, batch_size: int | None = None, workers: int = 2, nodes: int | None = None,
                    bandwidth: str | None = "1gbit", intra_bandwidth: str | None = None, network: str = "netns",
                    steps: int = 10, warmup: int = 3, seed: int = 0, cache: bool = True,
                    cache_dir: str | os.PathLike | None = None, timeout_s: float = 900.0,
                    log_stream: Any = sys.stderr) -> Profile:
    """The profile of ``workload`` as ``commsched bench`` with the same flags runs it.

    With ``cache`` a profile measured before on this machine with the same workload,
    batch size and cluster flags is returned as stored; otherwise it is measured
    (:func:`profile_workload`, about 4·steps + 2·steps steps of the workload, 7 of
    ``dynamic``, plus start-up) and stored. Raises ``ValueError`` on bad flags before anything runs,
    ``RuntimeError`` when the measurement failed (its logs are named).
    """
    from commsched.plugins.torch.bench.workloads import resolve_workload
    nodes = workers if nodes is None else nodes
    _check_cluster(workers, nodes)
    bandwidth, intra_bandwidth = _norm_rate(bandwidth), _norm_rate(intra_bandwidth)
    batch = batch_size or resolve_workload(workload).batch_size
    key = _cache_key(workload, batch, workers, nodes, bandwidth, intra_bandwidth, network, seed)
    path = cache_path(key, cache_dir)
    if cache and path.exists():
        try:
            return Profile.from_json(str(path))
        except ValueError as exc:
            log.warning("ignoring the unreadable cached profile %s: %s", path, exc)
    prof = profile_workload(workload, batch_size=batch, workers=workers, nodes=nodes, bandwidth=bandwidth,
                            intra_bandwidth=intra_bandwidth, network=network, steps=steps, warmup=warmup,
                            seed=seed, timeout_s=timeout_s, log_stream=log_stream)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.meta["cache_key"] = key
        tmp = path.with_suffix(".tmp")
        prof.to_json(str(tmp))
        os.replace(tmp, path)
    return prof


def _check_cluster(workers: int, nodes: int) -> None:
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if nodes < 1 or workers % nodes:
        raise ValueError(f"--nodes {nodes} must divide --workers {workers} (e.g. --workers 4 --nodes 2)")


def profile_workload(workload: str, *, batch_size: int, workers: int, nodes: int, bandwidth: str | None,
                     intra_bandwidth: str | None, network: str = "netns", steps: int = 10, warmup: int = 3,
                     seed: int = 0, timeout_s: float = 900.0, log_stream: Any = sys.stderr) -> Profile:
    """Measure ``workload`` on the bench's emulated cluster (always; see :func:`load_or_profile`).

    One phase of the bench's runner with this module as the worker: every rank runs
    the bench's baseline (``commsched.plugins.torch.bench.worker.run_baseline``: compute of
    all ranks at once, one rank alone, a flat all-reduce, compute under it), then the
    per-layer profile (:func:`profile_model`, all ranks at once behind a barrier).
    Rank 0's per-layer times are scaled to the bench's totals (:func:`_build`):
    forward, backward and optimizer of the slowest rank's medians, as
    ``commsched bench`` reports ``compute_s``. ``contention`` is the bench's compute
    beside a stream of all-reduces that outlasts it over the same compute alone, or where
    one all-reduce lasted the whole compute, the compute under it over compute
    (:func:`commsched.bench.report.contention_from`; ``meta['contention']`` shows how); ``comm_contention`` the same
    all-reduce under that compute over alone (:func:`commsched.bench.report.comm_contention`).
    ``per_piece_steal_s``: commsched's thread CPU per piece in a short ``dynamic`` run on every
    rank (:func:`_sched_cpu_per_piece`), the slowest rank's, times the machine's share (:func:`_steal`).
    """
    import shutil

    from commsched.bench.netns import NetworkSetupError, make_cluster
    from commsched.bench.procs import signals_raise
    from commsched.bench.report import contention_from, summarize_baseline
    from commsched.bench.runner import RunConfig, Runner, make_work_dir

    config = RunConfig(workload=workload, workers=workers, nodes=nodes, bandwidth=bandwidth,
                       intra_bandwidth=intra_bandwidth, strategies=[], steps=steps, warmup=warmup,
                       batch_size=batch_size, partition_bytes=1 << 20, credit_bytes=4 << 20, network=network,
                       seed=seed, phase_timeout_s=timeout_s, baseline_steps=steps)
    cluster = make_cluster(network, nodes, bandwidth, intra_bandwidth)
    work_dir = make_work_dir()
    try:
        with signals_raise(), cluster:
            phase = Runner(config, cluster, work_dir, worker_module=__name__, log=log_stream).run_phase(
                0, "profile", "baseline")
    except NetworkSetupError as exc:
        raise RuntimeError(f"cannot build the emulated network: {exc} (use --network loopback)") from exc
    if phase.status != "ok":
        raise RuntimeError(f"profiling {workload} failed: {phase.reason} (logs in {work_dir})")
    baseline = summarize_baseline(phase.ranks)
    r0 = phase.ranks[0]["profile"]
    contention, how = contention_from(baseline)
    meta = {
        "workload": workload, "workers": workers, "nodes": nodes, "bandwidth": bandwidth,
        "intra_bandwidth": intra_bandwidth, "network": network, "emulation": cluster.emulation,
        "emulation_note": cluster.note, "seed": seed, "bench_baseline": baseline, "contention": how,
        "param_bytes": phase.ranks[0]["param_bytes"], "machine": machine_fingerprint(),
        "per_rank_compute_s": [sum(_median(r[k]) for k in ("forward_s", "backward_s", "optimizer_s"))
                               for r in phase.ranks],
    }
    local = Profile.from_dict(r0)  # rank 0's layers, scaled to its own medians; rescaled to the bench's
    meta["local_compute_s"] = local.compute_s
    steal, meta["scheduler_cpu"] = _steal(phase.ranks, workers)
    handoff = handoff_from_times([r["handoff"] for r in phase.ranks])
    meta["handoff"] = dict(handoff, partition_bytes=phase.ranks[0]["handoff"]["partition_bytes"],
                           per_rank_pieces=[sum(len(v["order"]) for v in r["handoff"]["per_step"].values())
                                            for r in phase.ranks])
    prof = _build([layer.name for layer in local.layers], [layer.tensors for layer in local.layers],
                  local.meta["unscaled"], source=f"profile:{workload}", batch_size=batch_size,
                  forward_s=baseline["forward_s"], backward_s=baseline["backward_s"],
                  optimizer_s=baseline["optimizer_s"], contention=contention,
                  comm_contention=baseline.get("comm_contention") or 1.0, meta=meta, tied=local.tied)
    hook = _grad_hook(phase.ranks)
    link = _link_excess(phase.ranks, workers, nodes, bandwidth, intra_bandwidth, network, prof.comm_contention)
    two_level = _two_level_phases(phase.ranks, workers, nodes, bandwidth, intra_bandwidth, network)
    skew = _start_skew(phase.ranks)
    prof = dataclasses.replace(prof, per_piece_steal_s=steal, handoff_s=handoff["value"] or 0.0,
                               per_grad_hook_s=hook["value"], per_task_submit_s=hook["per_task_submit_s"],
                               per_piece_link_s=link["value"] or 0.0,
                               two_level_phases=_intra_node_phases(two_level),
                               two_level_skew_s=(skew.get("hierarchical") or {}).get("value") or 0.0,
                               meta=dict(prof.meta, grad_hook=hook, link_excess=link, two_level=two_level,
                                         start_skew=skew))
    shutil.rmtree(work_dir, ignore_errors=True)
    return prof


def _cores() -> int:
    """The cores this process (and the emulated cluster's ranks, all on this machine) may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _steal(ranks: list[dict[str, Any]], workers: int) -> tuple[float, dict[str, Any]]:
    """``per_piece_steal_s`` from the ranks' :func:`_sched_cpu_per_piece`: the largest CPU per piece
    (the slowest rank sets the step) × :func:`~commsched.costmodel.profile.steal_share` of the
    emulated cluster, whose ranks all run on this machine."""
    cores = _cores()
    per_piece = [r["sched_cpu"]["per_piece_s"] for r in ranks if (r.get("sched_cpu") or {}).get("per_piece_s")]
    cpu = max(per_piece) if per_piece else 0.0
    share = steal_share(workers, cores)
    return cpu * share, {"per_piece_cpu_s": cpu, "per_rank": [r.get("sched_cpu") for r in ranks], "cores": cores,
                         "ranks_on_machine": workers, "share": share,
                         "how": "CPU of commsched's threads per piece in a short dynamic run (schedstat), the "
                                "slowest rank; times steal_share(ranks on this machine, cores)"}


def _link_excess(ranks: list[dict[str, Any]], workers: int, nodes: int | None, bandwidth: str | None,
                 intra_bandwidth: str | None, network: str, comm_contention: float) -> dict[str, Any]:
    """``per_piece_link_s``: the network time one piece more costs beyond the closed form of the
    topology the simulator uses for these flags, the slope over the pieces of the ranks'
    :func:`_sched_cpu_per_piece` steps and their :func:`_small_pieces_stats` steps
    (:func:`~commsched.costmodel.profile.piece_cost_fit`); where no slope can be fitted (or the fit's stretch
    of the bytes is at 0 or below), the first
    run's excess over the closed form × ``comm_contention``
    (:func:`~commsched.costmodel.profile.link_excess_from_times`). Charged (``value``) only where
    the ranks outnumber the machine's cores, so a collective's every ring step waits for a core
    whether the model computes or not; with a core per rank the excess shows only beside compute,
    which ``comm_contention`` prices (docs/simulator.md), and is kept in ``measured`` alone."""
    from commsched.costmodel.collectives import allreduce_s
    from commsched.costmodel.topology import Topology

    topology = Topology.emulated(workers, nodes, "none" if network == "loopback" or not bandwidth else bandwidth,
                                 intra_bandwidth)

    def cost(nbytes: float) -> float:
        return allreduce_s(topology, nbytes)
    stats = [r.get("sched_cpu") or {} for r in ranks]
    single = link_excess_from_times(stats, cost, comm_contention)
    fit = None
    if all(r.get("small_pieces") for r in ranks):
        fit = piece_cost_fit([link_excess_from_times(stats, cost), link_excess_from_times(
            [r["small_pieces"] for r in ranks], cost)])
        fit["small_partition_bytes"] = ranks[0]["small_pieces"]["partition_bytes"]
    measured = fit["value"] if fit is not None and fit["value"] is not None else single["value"]
    cores = _cores()
    charged = workers > cores
    return dict(single, single_run=single["value"], fit=fit, measured=measured,
                value=measured if charged else None, charged=charged, ranks_on_machine=workers, cores=cores,
                topology=topology.to_dict(),
                how=("the slope of the network's busy time per piece over two piece sizes (fit); one run's "
                     "excess over the closed form x comm_contention (single_run) where no slope was fitted"))


def _start_skew(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``meta.start_skew`` per algorithm: :func:`~commsched.costmodel.profile.start_skew_from_times` over the steps
    of every short ``dynamic`` run the profile made, flat (the ``sched_cpu``, hand-off and small-pieces runs) and
    two-level (:func:`_two_level_stats`, where made), pooled per algorithm. The two-level value is
    ``Profile.two_level_skew_s``; the flat one a diagnostic the simulator does not use (docs/simulator.md,
    "Two-level phases and the ranks' start skew")."""
    runs = {"ring": [[r.get(key) or {} for r in ranks] for key in ("sched_cpu", "handoff", "small_pieces")]}
    if all(r.get("two_level") for r in ranks):
        runs["hierarchical"] = [[r["two_level"][i] for r in ranks] for i in range(2)]
    return {algorithm: pooled_start_skew(per_run) for algorithm, per_run in runs.items()}


def _hook_split(hook_s: float, hooks: int, task_hook_s: float, task_hooks: int) -> tuple[float, float] | None:
    """``(per gradient, per task)`` from ``hooks`` gradient hooks of ``hook_s`` seconds, ``task_hooks``
    of which (``task_hook_s``) submitted a task: the others only joined a fusion group, so they time
    a gradient's own work, and a submitting hook's excess over that is the task's submit. ``None``
    without both kinds."""
    members = hooks - task_hooks
    if members <= 0 or task_hooks <= 0:
        return None
    per_grad = (hook_s - task_hook_s) / members
    return per_grad, max(0.0, task_hook_s / task_hooks - per_grad)


def _grad_hook(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """``per_grad_hook_s`` and ``per_task_submit_s`` from the ranks' :func:`_sched_cpu_per_piece`, the
    rank with the most hook time (the slowest rank sets the step). Where a rank saw both kinds of hook, those that
    only joined a fusion group give the time per gradient, and those that submitted a task that
    much more per task (the decision and the inline launches); else the mean hook per gradient and
    nothing per task."""
    rows = []
    for r in ranks:
        c = r.get("sched_cpu") or {}
        if not c.get("hooks"):
            continue
        per_grad, per_task = (_hook_split(c["hook_s"], c["hooks"], c.get("task_hook_s", 0.0), c.get("task_hooks", 0))
                              or (c["hook_s"] / c["hooks"], 0.0))
        rows.append({"per_grad_s": per_grad, "per_task_s": per_task, "hook_s": c["hook_s"]})
    slowest = max(rows, key=lambda row: row["hook_s"]) if rows else {"per_grad_s": 0.0, "per_task_s": 0.0}
    return {"value": slowest["per_grad_s"], "per_task_submit_s": slowest["per_task_s"], "per_rank": rows,
            "how": "wall time of DistributedOptimizer._submit (the gradient hook's work: fusion copy, "
                   "Scheduler.submit and the launches it makes) in a short dynamic run, the slowest rank: per "
                   "gradient from the hooks that only joined a fusion group, per task the excess of those that "
                   "submitted one (all hooks per gradient where there were no fused gradients)"}


# -------------------------------------------------------------------- the worker
def _train(strat: Any, workload: Any, x: Any, y: Any, steps: int, progress: Any = None, label: str = "") -> None:
    """``steps`` training steps of ``strat`` on the batch, then wait for its communication; with
    ``progress``, one report per step under ``label``."""
    for i in range(steps):
        strat.zero_grad()
        workload.loss(strat.model(x), y).backward()
        strat.step()
        if progress is not None:
            progress(label, i + 1, steps)
    strat.synchronize()


def _sched_cpu_per_piece(spec: dict, rank: int, workload: Any, model: nn.Module, x: Any, y: Any,
                         progress: Any) -> dict[str, Any]:
    """CPU seconds of this rank's commsched threads (dispatch, completion, publish/order, and the piece
    completions on gloo's threads) per piece
    over :data:`SCHED_CPU_STEPS` steps of ``dynamic`` on the profiled ``model`` with the run's piece
    size and credit, as the bench measures its ``sched CPU`` column (``/proc/self/task/<tid>/schedstat``)."""
    from commsched.bench.spec import parse_strategies
    from commsched.plugins.torch.bench import worker
    from commsched.plugins.torch.bench.strategies import make_strategy

    (dynamic,) = parse_strategies("dynamic")
    strat = make_strategy(dynamic, model, worker._opt_factory(workload), run_spec=spec, rank=rank, timeline=None)
    recorder = strat.optimizer._recorder  # it times the gradient hook's work on the training thread
    try:
        _train(strat, workload, x, y, 2)
        (pieces0, _, callback0), cpu0 = worker._counters(strat), worker.thread_cpu_s()
        hooks0 = (recorder.hook_s, recorder.hooks, recorder.task_hook_s, recorder.task_hooks)
        _train(strat, workload, x, y, SCHED_CPU_STEPS, progress, "scheduler CPU")
        cpu1 = worker.thread_cpu_s()
        pieces1, _, callback1 = worker._counters(strat)
        by_thread = worker.with_callbacks(worker.thread_cpu_delta(cpu0, cpu1), callback0, callback1)
        pieces = (pieces1 or 0) - (pieces0 or 0)
        hooks = (recorder.hook_s - hooks0[0], recorder.hooks - hooks0[1], recorder.task_hook_s - hooks0[2],
                 recorder.task_hooks - hooks0[3])
        sched = strat.stats().get("scheduler") or {}  # the last steps' pieces: the link's excess per piece
    finally:
        strat.close()
    return {"cpu_s": sum(by_thread.values()), "by_thread_s": by_thread, "pieces": pieces,
            "per_step": sched.get("per_step") or {}, "issue_times": sched.get("issue_times") or {},
            "per_piece_s": sum(by_thread.values()) / pieces if pieces > 0 else None, "steps": SCHED_CPU_STEPS,
            "hook_s": hooks[0], "hooks": hooks[1], "per_hook_s": hooks[0] / hooks[1] if hooks[1] else None,
            "task_hook_s": hooks[2], "task_hooks": hooks[3]}


def _short_dynamic_run(workload: Any, model: nn.Module, x: Any, y: Any, progress: Any, piece_bytes: int,
                       credit_bytes: int, steps: int, label: str,
                       hierarchical: tuple[int, int] | None = None) -> dict[str, Any]:
    """This rank's ``Scheduler.stats()`` orders and issue times over ``steps`` steps (after 2 unmeasured)
    of ``dynamic`` with pieces of ``piece_bytes`` under a credit of ``credit_bytes``; with
    ``hierarchical`` (nodes, ranks per node) every piece two-level, and each phase's spans
    (``HierarchicalAllReduce.phase_times()``) under ``phases``."""
    from commsched.plugins.torch.bench import worker
    from commsched.plugins.torch.bench.strategies import CommschedStrategy

    strat = CommschedStrategy(model, worker._opt_factory(workload), "dynamic", piece_bytes, credit_bytes, None,
                              hierarchical=hierarchical)
    try:
        _train(strat, workload, x, y, 2)
        _train(strat, workload, x, y, steps, progress, label)
        sched = strat.stats().get("scheduler") or {}
        two_level = strat.optimizer._backend.hierarchical if hierarchical is not None else None
        phases = two_level.phase_times() if two_level is not None else None
    finally:
        strat.close()
    out = {"per_step": sched.get("per_step") or {}, "issue_times": sched.get("issue_times") or {},
           "partition_bytes": piece_bytes}
    if phases is not None:
        out["phases"] = {phase: [list(span) for span in spans] for phase, spans in phases.items()}
    return out


def _handoff_stats(workload: Any, model: nn.Module, x: Any, y: Any, progress: Any,
                   piece_bytes: int) -> dict[str, Any]:
    """:func:`_short_dynamic_run` of :data:`HANDOFF_STEPS` steps with one piece in flight (pieces of
    ``piece_bytes`` under a credit of one piece), for
    :func:`~commsched.costmodel.profile.handoff_from_times` over all ranks."""
    return _short_dynamic_run(workload, model, x, y, progress, piece_bytes, piece_bytes, HANDOFF_STEPS, "hand-off")


def _small_pieces_stats(workload: Any, model: nn.Module, x: Any, y: Any, progress: Any, piece_bytes: int,
                        credit_bytes: int) -> dict[str, Any]:
    """:func:`_short_dynamic_run` of :data:`SMALL_PIECES_STEPS` steps with pieces of ``piece_bytes`` //
    :data:`SMALL_PIECES_DIVISOR` under the run's credit: with the ``sched_cpu`` run's pieces, two sizes of
    piece over the same step, whose busy network times give the cost of one piece more
    (:func:`~commsched.costmodel.profile.piece_cost_fit`)."""
    small = max(SMALL_PIECES_MIN_BYTES, piece_bytes // SMALL_PIECES_DIVISOR)
    return _short_dynamic_run(workload, model, x, y, progress, small, credit_bytes, SMALL_PIECES_STEPS,
                              "small pieces")


def _two_level_stats(workload: Any, model: nn.Module, x: Any, y: Any, progress: Any, piece_bytes: int,
                     nodes: int, ranks_per_node: int) -> list[dict[str, Any]]:
    """Two :func:`_short_dynamic_run` of :data:`TWO_LEVEL_STEPS` steps with every piece two-level, pieces of
    ``piece_bytes`` and :data:`TWO_LEVEL_LARGE` times that, for ``Profile.two_level_phases``
    (:func:`~commsched.costmodel.profile.two_level_phase_fit`)."""
    large = piece_bytes * TWO_LEVEL_LARGE
    return [_short_dynamic_run(workload, model, x, y, progress, size, 4 * large, TWO_LEVEL_STEPS,
                               f"two-level pieces of {size >> 10} KiB", hierarchical=(nodes, ranks_per_node))
            for size in (piece_bytes, large)]


def _intra_node_phases(two_level: dict[str, Any] | None) -> dict[str, tuple[float, float]] | None:
    """What of :func:`_two_level_phases` the profile hands the simulator: the intra-node phases only. The
    inter-node all-reduce, timed from the last rank's issue, runs at its closed form (1.06 x measured on
    2 x 2 ranks, balanced, 500 Mbit/s); priced so, it drops what the ranks' waiting for each other costs,
    which the flat terms (``comm_contention``, ``per_piece_link_s``) partly carry, and the prediction moved
    away from the bench (1.487 to 1.416 s against 1.70-1.96 measured; docs/simulator.md). It stays in
    ``meta.two_level``."""
    value = (two_level or {}).get("value") or {}
    intra = {phase: cost for phase, cost in value.items() if phase != "all_reduce"}
    return intra or None


def _two_level_phases(ranks: list[dict[str, Any]], workers: int, nodes: int | None, bandwidth: str | None,
                      intra_bandwidth: str | None, network: str) -> dict[str, Any] | None:
    """``Profile.two_level_phases`` from the ranks' :func:`_two_level_stats`, against the phases' closed
    forms on the topology the simulator uses for these flags; None where the runs were not made (one
    node, or one rank per node)."""
    from commsched.costmodel.collectives import allreduce_phases
    from commsched.costmodel.topology import Topology

    if not all(r.get("two_level") for r in ranks):
        return None
    topology = Topology.emulated(workers, nodes, "none" if network == "loopback" or not bandwidth else bandwidth,
                                 intra_bandwidth)

    def cost(phase: str, nbytes: float) -> float:
        phases = allreduce_phases(topology, nbytes, "hierarchical")
        return phases[TWO_LEVEL_PHASES.index(phase)].seconds if len(phases) == 3 else 0.0
    runs = [two_level_phase_steps([r["two_level"][i] for r in ranks], topology.ranks_per_node, cost)
            for i in range(2)]
    fit = two_level_phase_fit(runs)
    return dict(fit, runs=runs, partition_bytes=[ranks[0]["two_level"][i]["partition_bytes"] for i in range(2)],
                topology=topology.to_dict())


def _worker_main(argv: list[str] | None = None) -> int:
    """One rank of a profile run (started by :func:`profile_workload` through the bench's runner)."""
    import torch.distributed as dist

    from commsched.plugins.torch.bench import worker
    from commsched.plugins.torch.bench.workloads import get_workload

    spec, rank = worker.start_rank(argv, "commsched profile worker (started by commsched profile)")
    progress = worker.Progress(spec["run_dir"], rank == 0)
    try:
        result = worker.run_baseline(spec, rank, progress)  # the bench's own baseline, unchanged
        wl = get_workload(spec["workload"])
        torch.manual_seed(spec["seed"])
        model = wl.build()
        gen = torch.Generator().manual_seed(spec["seed"] + 1 + rank)
        x, y = wl.make_batch(spec["batch_size"], gen)
        opt = worker._opt_factory(wl)(model.parameters())
        progress("layers", 0, 1)
        prof = profile_model(model, x, y, wl.loss, opt, steps=spec["baseline_steps"], warmup=1,
                             barrier=dist.barrier)
        result["profile"] = prof.to_dict()
        progress("layers", 1, 1)
        dist.barrier()
        result["sched_cpu"] = _sched_cpu_per_piece(spec, rank, wl, model, x, y, progress)
        dist.barrier()
        result["handoff"] = _handoff_stats(wl, model, x, y, progress, spec["partition_bytes"])
        dist.barrier()
        result["small_pieces"] = _small_pieces_stats(wl, model, x, y, progress, spec["partition_bytes"],
                                                     spec["credit_bytes"])
        dist.barrier()
        nodes = spec.get("nodes") or spec["world_size"]
        if 1 < nodes < spec["world_size"]:
            result["two_level"] = _two_level_stats(wl, model, x, y, progress, spec["partition_bytes"], nodes,
                                                   spec["world_size"] // nodes)
            dist.barrier()
    except Exception:  # noqa: BLE001 - any failure: print it, exit non-zero at once (peers then fail fast)
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    result["rank"] = rank
    worker._write_json(os.path.join(spec["run_dir"], f"rank{rank}.json"), result)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the bench worker: gloo may abort in interpreter teardown


# ------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``commsched profile`` flags."""
    from commsched.bench.cli import WORKLOAD_CHOICES  # noqa: F401 - named in the help
    from commsched.plugins.torch.probe import _positive, add_cluster_arguments
    parser.description = ("Profile a benchmark workload as `commsched bench` runs it with the same flags: "
                          "per-layer forward/backward/ready/apply times, gradient tensors, contention.")
    parser.add_argument("--workload", required=True,
                        help=f"model to profile: one of {', '.join(WORKLOAD_CHOICES)}, or module:function "
                             "(see docs/torch.md)")
    parser.add_argument("--batch-size", type=_positive, default=None,
                        help="samples per worker per step (default: the workload's)")
    parser.add_argument("--steps", type=_positive, default=10,
                        help="measured steps of each baseline measurement and of the layer profile (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default 3)")
    add_cluster_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the workers are killed")
    parser.add_argument("--json", required=True, metavar="PATH", help="write the profile here")
    parser.add_argument("--cached", action="store_true",
                        help=f"reuse a cached profile of the same flags on this machine ({DEFAULT_CACHE_DIR})")


def run(args: argparse.Namespace) -> int:
    """``commsched profile``: 0 when the profile is written, 1 when measuring failed, 2 on bad flags."""
    nodes = args.workers if args.nodes is None else args.nodes
    try:
        _check_cluster(args.workers, nodes)
        prof = load_or_profile(args.workload, batch_size=args.batch_size, workers=args.workers, nodes=nodes,
                               bandwidth=args.bandwidth, intra_bandwidth=args.intra_bandwidth,
                               network=args.network, steps=args.steps, warmup=args.warmup, seed=args.seed,
                               cache=True, timeout_s=args.timeout, cache_dir=None) if args.cached else None
        if prof is None:
            prof = _fresh(args, nodes)
    except ValueError as exc:
        print(f"commsched profile: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"commsched profile: {exc}", file=sys.stderr)
        return 1
    prof.to_json(args.json)
    print(format_profile(prof))
    return 0


def _fresh(args: argparse.Namespace, nodes: int) -> Profile:
    """Measure now and store the result in the cache too (``simulate`` then reuses it)."""
    from commsched.plugins.torch.bench.workloads import get_workload
    batch = args.batch_size or get_workload(args.workload).batch_size
    bandwidth, intra = _norm_rate(args.bandwidth), _norm_rate(args.intra_bandwidth)
    prof = profile_workload(args.workload, batch_size=batch, workers=args.workers, nodes=nodes,
                            bandwidth=bandwidth, intra_bandwidth=intra, network=args.network, steps=args.steps,
                            warmup=args.warmup, seed=args.seed, timeout_s=args.timeout)
    key = _cache_key(args.workload, batch, args.workers, nodes, bandwidth, intra, args.network, args.seed)
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.meta["cache_key"] = key
        prof.to_json(str(path))
    except OSError as exc:
        log.warning("could not cache the profile in %s: %s", path, exc)
    return prof


def format_profile(prof: Profile) -> str:
    """A plain-text table of a profile (what ``commsched profile`` prints)."""
    rows = [f"{'layer':<16} {'MB':>8} {'fwd ms':>8} {'bwd ms':>8} {'ready ms':>9} {'apply ms':>9}"]
    for layer, ready in zip(prof.layers, prof.ready_times(), strict=True):
        rows.append(f"{layer.name:<16} {layer.grad_bytes / 1e6:8.2f} {layer.forward_s * 1e3:8.1f} "
                    f"{layer.backward_s * 1e3:8.1f} {ready * 1e3:9.1f} {layer.apply_s * 1e3:9.2f}")
    rows.append(f"forward {prof.forward_s * 1e3:.1f} ms, backward {prof.backward_s * 1e3:.1f} ms, apply "
                f"{prof.apply_s * 1e3:.1f} ms, overhead {prof.step_overhead_s * 1e3:.1f} ms, compute "
                f"{prof.compute_s * 1e3:.1f} ms, contention {prof.contention:.3f} (compute under comm), "
                f"{prof.comm_contention:.3f} (comm under compute)")
    base = prof.meta.get("bench_baseline")
    if base:
        rows.append(f"bench baseline: compute {base['compute_s'] * 1e3:.1f} ms (optimizer.step "
                    f"{base['optimizer_s'] * 1e3:.1f} ms), comm {base['comm_s'] * 1e3:.1f} ms, compute under "
                    f"comm {base['compute_under_comm_s'] * 1e3:.1f} ms")
    sched = prof.meta.get("scheduler_cpu")
    if sched:
        rows.append(f"commsched's threads: {sched['per_piece_cpu_s'] * 1e6:.0f} us of CPU a piece; the compute pays "
                    f"{prof.per_piece_steal_s * 1e6:.0f} us a piece ({sched['ranks_on_machine']} ranks on "
                    f"{sched['cores']} cores, share {sched['share']:.2f})")
    handoff = prof.meta.get("handoff")
    if handoff and handoff.get("pairs"):
        rows.append(f"hand-off with one piece in flight: the link idles {prof.handoff_s * 1e3:.2f} ms a piece "
                    f"(mean of {handoff['pairs']}; p50 {handoff['p50'] * 1e3:.2f}, p90 {handoff['p90'] * 1e3:.2f} ms)")
    link = prof.meta.get("link_excess")
    if link and link.get("measured") is not None:
        fit = link.get("fit") or {}
        how = (f"slope over pieces of two sizes, bytes stretched {fit['contention']:.2f}x"
               if fit.get("value") is not None else "one run's excess over the closed form")
        rows.append(f"the network: {link['measured'] * 1e3:.2f} ms a piece beyond the closed form ({how}); "
                    + ("charged" if link.get("charged") else
                       f"not charged ({link['ranks_on_machine']} ranks on {link['cores']} cores)"))
    measured = ((prof.meta.get("two_level") or {}).get("value") or {})
    if measured:
        cut = {"reduce_scatter": "intra reduce-scatter", "all_reduce": "inter all-reduce",
               "all_gather": "intra all-gather"}
        rows.append("two-level pieces, measured per phase (closed form x stretch + per piece): " + "; ".join(
            f"{cut[phase]} x{m:.2f} + {c * 1e3:.2f} ms" + ("" if phase in (prof.two_level_phases or {}) else
                                                          " (not modelled)")
            for phase, (m, c) in measured.items()))
    skew = {k: v["value"] for k, v in (prof.meta.get("start_skew") or {}).items() if v.get("value") is not None}
    if skew:
        rows.append("the last rank starts a step's communication " + ", ".join(
            f"{seconds * 1e3:.1f} ms"
            + (" (two-level, modelled)" if algorithm == "hierarchical" else " (flat, not modelled)")
            for algorithm, seconds in skew.items()) + " after the first (mean over the profile's steps)")
    if prof.per_grad_hook_s:
        tensors = sum(len(layer.tensors) for layer in prof.layers)
        rows.append(f"commsched's gradient hook: {prof.per_grad_hook_s * 1e6:.0f} us a gradient on the training "
                    f"thread, {prof.per_grad_hook_s * tensors * 1e3:.1f} ms a step over {tensors} gradients")
    if prof.per_task_submit_s:
        rows.append(f"  and {prof.per_task_submit_s * 1e6:.0f} us more in a hook that submits a task (its decision and "
                    "inline launches; a fused run of gradients pays it once)")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(_worker_main())
