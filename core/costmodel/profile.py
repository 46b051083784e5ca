"""The model of one training step, as the simulator, the planner and the tuner read it.

A :class:`Profile` lists the layers of a model in forward order. For each layer: its
forward and backward compute time, the gradient tensors it produces (name, elements,
element size), when within backward each of them is ready, and the time to apply the
optimizer to its parameters. Machine-wide: how much compute slows down while
communication runs on the same machine (``contention``), and time per step outside
the layers. Sources: a profiling run of a workload (``commsched profile``), a user's
own training (``DistributedOptimizer.profile()``), or the built-in zoo
(:mod:`commsched.costmodel.zoo`).

Times are seconds, sizes bytes. JSON (``to_json``/``from_json``) carries
:data:`SCHEMA`; a file of another schema, or with a bad field, is refused with a
``ValueError`` naming the field.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

__all__ = ["SCHEMA", "TWO_LEVEL_PHASES", "LayerProfile", "Profile", "TensorSpec", "check_schema",
           "handoff_from_times", "link_excess_from_times", "load_json", "merged_spans", "overlap_s",
           "piece_cost_fit", "pooled_start_skew",
           "read_json", "start_skew_from_times", "steal_share", "two_level_phase_fit", "two_level_phase_steps",
           "union_s", "write_json"]

SCHEMA = "commsched-profile/1"
#: The phases of a two-level piece, in pipeline order (the keys of ``Profile.two_level_phases``; the
#: torch runtime's ``HierarchicalAllReduce.phase_times()`` names them so)
TWO_LEVEL_PHASES = ("reduce_scatter", "all_reduce", "all_gather")


def _check_time(where: str, name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {name}={value!r} must be a finite number of seconds >= 0")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """One gradient tensor: the name the scheduler gets, its element count and element size;
    ``shape`` and ``dtype`` (e.g. ``"float32"``) when the source knows them (a plan's
    fingerprint compares them)."""

    name: str
    numel: int
    element_size: int = 4
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"tensor name {self.name!r} must be a non-empty string")
        if int(self.numel) < 0 or int(self.element_size) <= 0:
            raise ValueError(f"tensor {self.name!r}: numel={self.numel!r} must be >= 0 and "
                             f"element_size={self.element_size!r} > 0")


@dataclass(frozen=True)
class LayerProfile:
    """One layer (a module that owns parameters), in forward order.

    ``ready_s``: when, counted from the start of backward, this layer's gradients
    are ready; ``None`` means "when this layer's backward ends" (backward runs the
    layers in reverse order, so that is the sum of the backward times of this layer
    and every later one).
    """

    name: str
    forward_s: float
    backward_s: float
    tensors: tuple[TensorSpec, ...] = ()
    apply_s: float = 0.0
    ready_s: float | None = None

    def __post_init__(self) -> None:
        where = f"layer {self.name!r}"
        for key in ("forward_s", "backward_s", "apply_s"):
            _check_time(where, key, getattr(self, key))
        if self.ready_s is not None:
            _check_time(where, "ready_s", self.ready_s)

    @property
    def grad_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Profile:
    """A step of a model on one rank (data parallelism: every rank runs the same step).

    ``contention`` ≥ 1: compute runs this many times slower while communication is in
    progress on the same machine (measured: forward + backward under a concurrent
    all-reduce / alone). ``comm_contention`` ≥ 1: the other way round, communication
    runs this many times slower while compute runs (on CPUs the engine's reductions and
    copies share the cores with the model; measured: the same all-reduce under compute /
    alone; 1 where the source did not measure it, e.g. the zoo's GPUs).
    ``step_overhead_s``: per step, outside the layers (loss, data).
    ``per_piece_cpu_s``: the scheduler's own CPU per piece on the piece's own path, time the
    network waits for it (``python -m commsched.bench.overhead``: issuing one collective).
    ``per_piece_steal_s``: compute time a rank loses per piece to commsched's threads, where
    they share the cores the model computes on (measured by ``commsched profile``: their CPU
    per piece in a short ``dynamic`` run, times :func:`steal_share`; 0 where not measured, and
    on GPUs). ``optimizer_step_s``: the wrapped optimizer's own
    ``step()`` over all parameters at once, as DDP, Horovod and the synchronous path
    call it (``None``: the sum of the layers' ``apply_s``, the per-layer update that
    cross-iteration runs in the next forward).
    ``handoff_s``: how long the link stays idle when a piece waited for another to land
    (one piece in flight): from the collective's end to the last rank's issue of the next
    piece (its completion seen on the engine's thread, the scheduler's dispatch, the
    follower's wait for rank 0's decision, each behind the model's Python for the GIL).
    Measured by ``commsched profile`` (:func:`handoff_from_times`); 0 where not measured.
    ``tied``: the tensors that are a tied embedding's weight (one parameter used by the input
    lookup, first in forward, and the output projection, last), which PyTorch's
    ``DistributedOptimizer(split_tied_embeddings=True)`` splits; :meth:`with_tied_split` models
    the split.
    ``per_grad_hook_s``: the training thread's own time per gradient in commsched's hook, inside
    backward (PyTorch: a fused member's copy into its buffer; ``Scheduler.submit``'s decision and
    launch of what fits, pieces up to ``INLINE_MAX_BYTES``): each layer's backward is that much
    longer per tensor under a commsched strategy, and its pieces start that much later (measured
    by ``commsched profile`` in its ``dynamic`` run and by ``opt.profile()`` in the training it
    recorded, which takes it out of the layers' backward; 0 where not measured, e.g. the zoo).
    Where the profile saw both kinds of hook, it is a gradient that only joined a fusion
    group, and ``per_task_submit_s`` is what a hook that submits a task takes beyond that (the
    decision and inline launch of its pieces, once per task: a fused run of many gradients pays it
    once). 0 where not measured: then ``per_grad_hook_s`` is the mean of all hooks.
    ``per_piece_link_s``: the time a commsched piece holds the network beyond its closed form
    (the topology's α-β cost, times ``comm_contention``): where ranks share a machine's cores,
    each collective's software steps wait for CPU. Measured by ``commsched profile`` in two short
    ``dynamic`` runs whose pieces differ in size, as the slope of the network's busy time per piece
    (:func:`piece_cost_fit`; one run's :func:`link_excess_from_times` where no slope can be fitted or the
    fit's stretch of the bytes is at 0 or below),
    and charged only where the ranks outnumber the machine's cores; 0 elsewhere and where not measured.
    ``two_level_phases``: how a two-level piece's phases run in this workload's step, measured
    (``commsched profile`` on several nodes of several ranks: two short ``dynamic`` runs with every
    piece two-level, pieces of two sizes; :func:`two_level_phase_fit`): per phase of
    :data:`TWO_LEVEL_PHASES`, ``(stretch, per_piece_s)``, the phase of a piece of closed form ``t``
    holding its link ``stretch × t + per_piece_s``, compute beside it included (the simulator then
    neither slows it by ``comm_contention`` nor adds ``per_piece_link_s``). Measured on 2 nodes × 2
    ranks on 2 cores (balanced, 500 Mbit/s): the intra-node reduce-scatter 5.8 × + 1.4 ms and
    all-gather 2.9 × + 1.0 ms (their closed form about 0.6 ms a 1 MiB piece). ``commsched profile``
    gives the intra-node phases only: the inter-node one measured 1.06 × its closed form, and priced
    so it moved the prediction away from the bench (its ``meta.two_level``; docs/simulator.md).
    ``None`` (or a phase left out): the closed form as for any collective.
    ``two_level_skew_s``: how long after a gradient is ready on the simulated rank a two-level piece
    of it can start, the credit held meanwhile: the ranks' start skew of two-level pieces (the
    last rank's issue of a step's first piece minus the first rank's, mean over the steps of
    ``commsched profile``'s two-level runs: :func:`start_skew_from_times`). On several nodes of
    ranks sharing cores, node 1's ranks end a step's last all-gather later than node 0's and start
    the next backward that much later, so every piece waits for them; a piece decided later than
    that after its gradient was ready pays nothing. Measured on 2 nodes × 2 ranks on 2 cores
    (balanced, 500 Mbit/s): 174 ms, against 47 ms for flat pieces, which the simulator does not
    charge (as a delay of flat pieces it made the saved 2 × 2 grids worse; docs/simulator.md). 0
    where not measured, and on GPUs.
    ``ranged``: the tensors whose update the runtime may run range by range while the next
    forward waits for their pieces (PyTorch's ranged apply: cross-iteration, an element-wise
    optimizer class on CPU whose state is shaped like the parameter); ``()`` none (on a GPU,
    Horovod averaging, an optimizer that couples parameters); ``None`` not recorded: every
    tensor (the bench workloads' SGD with momentum on CPU can). The simulator's ranged apply
    (``SimSettings.ranged_apply``) covers only these.
    """

    layers: tuple[LayerProfile, ...]
    source: str = "unknown"
    batch_size: int | None = None
    contention: float = 1.0
    step_overhead_s: float = 0.0
    per_piece_cpu_s: float = 12e-6
    optimizer_step_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    comm_contention: float = 1.0
    per_piece_steal_s: float = 0.0
    tied: tuple[str, ...] = ()
    handoff_s: float = 0.0
    ranged: tuple[str, ...] | None = None
    per_grad_hook_s: float = 0.0
    per_task_submit_s: float = 0.0
    per_piece_link_s: float = 0.0
    two_level_phases: dict[str, tuple[float, float]] | None = None
    two_level_skew_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a profile needs at least one layer")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            repeated = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"layer names must be unique; repeated: {repeated}")
        tensors = [t.name for layer in self.layers for t in layer.tensors]
        if len(set(tensors)) != len(tensors):
            raise ValueError("tensor names must be unique across layers")
        if not (math.isfinite(self.contention) and self.contention >= 1.0):
            raise ValueError(f"contention={self.contention!r} must be >= 1 (compute under communication / alone)")
        if not (math.isfinite(self.comm_contention) and self.comm_contention >= 1.0):
            raise ValueError(f"comm_contention={self.comm_contention!r} must be >= 1 "
                             "(communication under compute / alone)")
        _check_time("profile", "step_overhead_s", self.step_overhead_s)
        _check_time("profile", "per_piece_cpu_s", self.per_piece_cpu_s)
        _check_time("profile", "per_piece_steal_s", self.per_piece_steal_s)
        _check_time("profile", "handoff_s", self.handoff_s)
        _check_time("profile", "per_grad_hook_s", self.per_grad_hook_s)
        _check_time("profile", "per_task_submit_s", self.per_task_submit_s)
        _check_time("profile", "per_piece_link_s", self.per_piece_link_s)
        _check_time("profile", "two_level_skew_s", self.two_level_skew_s)
        if self.optimizer_step_s is not None:
            _check_time("profile", "optimizer_step_s", self.optimizer_step_s)
        if self.two_level_phases is not None:
            phases = {}
            for phase, cost in dict(self.two_level_phases).items():
                if phase not in TWO_LEVEL_PHASES:
                    raise ValueError(f"two_level_phases: unknown phase {phase!r}; the phases are {TWO_LEVEL_PHASES}")
                stretch, per_piece = (float(x) for x in cost)
                if not (math.isfinite(stretch) and stretch > 0):
                    raise ValueError(f"two_level_phases[{phase!r}]: stretch={stretch!r} must be > 0")
                _check_time("profile", f"two_level_phases[{phase!r}] per_piece_s", per_piece)
                phases[phase] = (stretch, per_piece)
            object.__setattr__(self, "two_level_phases", phases)
        object.__setattr__(self, "tied", tuple(self.tied))
        unknown = [n for n in self.tied if n not in tensors]
        if unknown:
            raise ValueError(f"tied={unknown} names no tensor of the profile")
        if self.ranged is not None:
            object.__setattr__(self, "ranged", tuple(self.ranged))
            unknown = [n for n in self.ranged if n not in tensors]
            if unknown:
                raise ValueError(f"ranged={unknown} names no tensor of the profile")

    # ------------------------------------------------------------- derived
    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    @property
    def apply_s(self) -> float:
        return sum(layer.apply_s for layer in self.layers)

    @property
    def step_optimizer_s(self) -> float:
        """The optimizer's ``step()`` over all parameters at once (see ``optimizer_step_s``)."""
        return self.apply_s if self.optimizer_step_s is None else self.optimizer_step_s

    @property
    def compute_s(self) -> float:
        """Forward + backward + one optimizer step + per-step overhead, with no communication
        (the bench's ``compute_s``)."""
        return self.forward_s + self.backward_s + self.step_optimizer_s + self.step_overhead_s

    @property
    def grad_bytes(self) -> int:
        return sum(layer.grad_bytes for layer in self.layers)

    def tensor_names(self) -> list[str]:
        """Every tensor's name, layer by layer in forward order."""
        return [t.name for layer in self.layers for t in layer.tensors]

    def ready_times(self) -> list[float]:
        """For each layer (forward order), when its gradients are ready, from the start of backward."""
        out = [0.0] * len(self.layers)
        total = 0.0
        for i in range(len(self.layers) - 1, -1, -1):
            total += self.layers[i].backward_s
            given = self.layers[i].ready_s
            out[i] = total if given is None else given
        return out

    def drift(self, compute_s: float | None) -> float | None:
        """How much slower (> 0) or faster the machine computes now than when this profile was measured:
        ``compute_s`` (a bench's own baseline: forward + backward + optimizer of every rank at once, no
        communication) against the same baseline the profiler took (``meta["bench_baseline"]``), or this
        profile's compute without its per-step overhead where there is none (``opt.profile()``), minus 1.
        None when either is unknown. ``scaled(compute=1 + drift)`` is the profile at today's speed."""
        then = (self.meta.get("bench_baseline") or {}).get("compute_s") or self.compute_s - self.step_overhead_s
        return compute_s / then - 1.0 if compute_s and then and then > 0 else None

    def scaled(self, *, compute: float = 1.0, grad: float = 1.0, source: str | None = None) -> "Profile":
        """The same model with compute times × ``compute`` and gradient sizes × ``grad`` (rounded to
        whole elements). How ``--tp``/``--pp`` shards are modelled: each data-parallel rank holds
        1/(tp·pp) of the parameters and does 1/(tp·pp) of the compute (ignoring their own
        communication, which is stated wherever it is used)."""
        if compute <= 0 or grad <= 0:
            raise ValueError(f"scale factors must be positive, got compute={compute}, grad={grad}")
        layers = tuple(LayerProfile(
            name=layer.name, forward_s=layer.forward_s * compute, backward_s=layer.backward_s * compute,
            apply_s=layer.apply_s * compute, ready_s=None if layer.ready_s is None else layer.ready_s * compute,
            tensors=tuple(TensorSpec(t.name, max(1, round(t.numel * grad)) if t.numel else 0, t.element_size)
                          for t in layer.tensors)) for layer in self.layers)
        return Profile(layers=layers, source=source or self.source, batch_size=self.batch_size,
                       contention=self.contention, step_overhead_s=self.step_overhead_s * compute,
                       per_piece_cpu_s=self.per_piece_cpu_s, meta=dict(self.meta),
                       optimizer_step_s=None if self.optimizer_step_s is None else self.optimizer_step_s * compute,
                       comm_contention=self.comm_contention, per_piece_steal_s=self.per_piece_steal_s,
                       tied=self.tied, handoff_s=self.handoff_s, ranged=self.ranged,
                       per_grad_hook_s=self.per_grad_hook_s, per_piece_link_s=self.per_piece_link_s,
                       per_task_submit_s=self.per_task_submit_s, two_level_phases=self.two_level_phases,
                       two_level_skew_s=self.two_level_skew_s)

    def with_tied_split(self, names: Sequence[str] | None = None, *, ready_s: float | None = None) -> "Profile":
        """The step as ``split_tied_embeddings=True`` runs it: each tied weight's gradient (``names``,
        default :attr:`tied`) is ready when the output projection's backward made it, not when
        backward reaches the input lookup at its end.

        The projection is the model's last layer, first in backward, so its part is ready with the
        first gradients backward makes: ``ready_s`` (default: the earliest ready time of the other
        layers). A tied tensor that shares its layer with others is moved to a layer of its own
        just before it (forward order, hence priority, unchanged; the apply time divided by bytes),
        so the others keep their own readiness. Not modelled: the lookup's rows, which the runtime
        all-gathers on a group of its own at the end of backward (distinct tokens x dim per rank,
        small beside the dense weight; docs/simulator.md).
        """
        chosen = tuple(self.tied if names is None else names)
        if not chosen:
            raise ValueError("with_tied_split: the profile names no tied embedding (Profile.tied is empty); "
                             "profile a model whose input embedding's weight is also its output projection's")
        known = {t.name for layer in self.layers for t in layer.tensors}
        unknown = [n for n in chosen if n not in known]
        if unknown:
            raise ValueError(f"with_tied_split: {unknown} names no tensor of the profile")
        done = set(self.meta.get("tied_split") or ())
        if done.issuperset(chosen):
            return self  # split already (e.g. opt.profile() of a run with the split: its readiness is measured)
        ready = self.ready_times()
        holders = [i for i, layer in enumerate(self.layers) if any(t.name in chosen for t in layer.tensors)]
        if ready_s is None:
            others = [ready[i] for i in range(len(self.layers)) if i not in holders]
            if not others:
                raise ValueError("with_tied_split: every layer holds a tied weight; give ready_s")
            ready_s = min(others)
        _check_time("with_tied_split", "ready_s", ready_s)
        layers: list[LayerProfile] = []
        for i, layer in enumerate(self.layers):
            if i not in holders:
                layers.append(layer)
                continue
            tied = tuple(t for t in layer.tensors if t.name in chosen)
            rest = tuple(t for t in layer.tensors if t.name not in chosen)
            if not rest:
                layers.append(replace(layer, ready_s=ready_s))
                continue
            share = sum(t.nbytes for t in tied) / max(1, layer.grad_bytes)
            name = f"{layer.name}[tied]"
            while name in {x.name for x in self.layers}:
                name += "_"
            layers.append(LayerProfile(name=name, forward_s=0.0, backward_s=0.0, tensors=tied,
                                       apply_s=layer.apply_s * share, ready_s=ready_s))
            # the layer keeps its own readiness: the end of its backward, as before the split
            layers.append(replace(layer, tensors=rest, apply_s=layer.apply_s * (1.0 - share), ready_s=ready[i]))
        # a split weight's gradient is two parts reduced apart: the runtime applies it whole
        ranged = tuple(n for n in (self.ranged if self.ranged is not None else self.tensor_names()) if n not in chosen)
        return replace(self, layers=tuple(layers), meta=dict(self.meta, tied_split=sorted(done | set(chosen))),
                       ranged=ranged)

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["schema"] = SCHEMA
        return out

    def to_json(self, path: str) -> None:
        write_json(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        check_schema(data, SCHEMA, "profile", "make one with `commsched profile --workload W --json profile.json` "
                     "or DistributedOptimizer.profile()")
        try:
            layers = tuple(LayerProfile(
                name=layer["name"], forward_s=layer["forward_s"], backward_s=layer["backward_s"],
                apply_s=layer.get("apply_s", 0.0), ready_s=layer.get("ready_s"),
                tensors=tuple(TensorSpec(t["name"], int(t["numel"]), int(t.get("element_size", 4)),
                                         None if t.get("shape") is None else tuple(int(d) for d in t["shape"]),
                                         t.get("dtype"))
                              for t in layer.get("tensors", ()))) for layer in data["layers"])
            return cls(layers=layers, source=data.get("source", "unknown"), batch_size=data.get("batch_size"),
                       contention=float(data.get("contention", 1.0)),
                       comm_contention=float(data.get("comm_contention", 1.0)),
                       step_overhead_s=float(data.get("step_overhead_s", 0.0)),
                       per_piece_cpu_s=float(data.get("per_piece_cpu_s", 12e-6)), meta=dict(data.get("meta", {})),
                       optimizer_step_s=data.get("optimizer_step_s"),
                       per_piece_steal_s=float(data.get("per_piece_steal_s", 0.0)),
                       tied=tuple(str(n) for n in data.get("tied", ())),
                       handoff_s=float(data.get("handoff_s", 0.0)),
                       ranged=None if data.get("ranged") is None else tuple(str(n) for n in data["ranged"]),
                       per_grad_hook_s=float(data.get("per_grad_hook_s", 0.0)),
                       per_task_submit_s=float(data.get("per_task_submit_s", 0.0)),
                       per_piece_link_s=float(data.get("per_piece_link_s", 0.0)),
                       two_level_phases=None if data.get("two_level_phases") is None else {
                           str(k): (float(v[0]), float(v[1])) for k, v in data["two_level_phases"].items()},
                       two_level_skew_s=float(data.get("two_level_skew_s", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ValueError(f"the profile is missing or mistypes a field ({exc}); see "
                             "commsched.costmodel.profile for the schema") from None

    @classmethod
    def from_json(cls, path: str) -> "Profile":
        return load_json(path, cls.from_dict)


def handoff_from_times(ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The link's idle time per hand-off, from every rank's ``Scheduler.stats()`` (its
    ``per_step`` orders and ``issue_times``) in a run with one piece in flight; the clocks must
    be one clock (ranks of one machine).

    For two pieces started one after the other in a step (by rank 0's order; a piece is found
    on the other ranks by name), where the second's data was ready on every rank before the
    first landed (so it waited for the first, not for its data): the gap from the first rank
    to see the first land to the last rank to issue the second, which is when its collective
    can start. ``value`` is their mean (the step pays each one; a negative gap, clock noise,
    counts as 0), ``None`` without a single such pair."""
    if not ranks:
        raise ValueError("handoff_from_times needs the stats of at least one rank")
    # steps by str(step): the same whether the stats came through JSON or not
    stats = [({str(k): v["order"] for k, v in (r.get("per_step") or {}).items()},
              {str(k): v for k, v in (r.get("issue_times") or {}).items()}) for r in ranks]
    gaps: list[float] = []
    for step, lead_order in stats[0][0].items():
        if any(step not in times or step not in orders for orders, times in stats):
            continue
        slots = [{name: i for i, name in enumerate(orders[step])} for orders, _ in stats]
        for first, second in zip(lead_order, lead_order[1:], strict=False):
            if any(first not in s or second not in s for s in slots):
                continue
            at = [(times[step], s[first], s[second]) for (_, times), s in zip(stats, slots, strict=True)]
            landed = [t["landed_at"][i] for t, i, _ in at]
            if any(v is None for v in landed):
                continue
            free = min(landed)
            if max(t["ready_at"][j] for t, _, j in at) > free:
                continue  # the second waited for its data, not for the first
            gaps.append(max(0.0, max(t["issued_at"][j] for t, _, j in at) - free))
    gaps.sort()

    def pick(q: float) -> float | None:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else None
    return {"value": sum(gaps) / len(gaps) if gaps else None, "pairs": len(gaps), "p50": pick(0.5),
            "p90": pick(0.9), "how": "mean over consecutive pieces, the second ready before the first landed, "
                                     "of (last rank's issue of the second - first rank's landing of the first)"}


def merged_spans(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(start, end)`` spans merged where they touch or overlap, in order."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def overlap_s(spans: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """How long ``spans`` (disjoint: :func:`merged_spans`) cover of ``window``."""
    lo, hi = window
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def union_s(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` spans: how long at least one of them ran."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def _by_step(ranks: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each rank's ``Scheduler.stats()`` ``per_step`` and ``issue_times``, keyed by ``str(step)`` (the same
    whether the stats came through JSON or not)."""
    return [({str(k): v for k, v in (r.get("per_step") or {}).items()},
             {str(k): v for k, v in (r.get("issue_times") or {}).items()}) for r in ranks]


def link_excess_from_times(ranks: Sequence[dict[str, Any]], piece_cost: Callable[[float], float],
                           comm_contention: float = 1.0) -> dict[str, Any]:
    """The network time per piece beyond the model's closed form, from every rank's
    ``Scheduler.stats()`` (``per_step`` and ``issue_times``, one clock: ranks of one machine).

    Per step: a piece's collective runs from the last rank's issue to the first rank's landing
    (found on the other ranks by name); the union of those spans is the time the network had a
    piece of commsched's. Against it, ``piece_cost(mean piece bytes)`` × pieces × ``comm_contention``
    (every piece as if slowed by compute beside it, so what the simulator slows is not counted
    twice). ``value``: the median over steps of (union − that) / pieces, floored at 0; ``None``
    without a step every rank recorded."""
    if not ranks:
        raise ValueError("link_excess_from_times needs the stats of at least one rank")
    if not comm_contention >= 1.0:
        raise ValueError(f"comm_contention={comm_contention!r} must be >= 1")
    stats = _by_step(ranks)
    steps: list[dict[str, float]] = []
    for step, lead in stats[0][0].items():
        if any(step not in per or step not in times for per, times in stats) or not lead.get("pieces"):
            continue
        slots = [{name: i for i, name in enumerate(per[step]["order"])} for per, _ in stats]
        spans = []
        for name in lead["order"]:
            if any(name not in s for s in slots):
                continue
            ends = [times[step]["landed_at"][s[name]] for (_, times), s in zip(stats, slots, strict=True)]
            if any(e is None for e in ends):
                continue
            start = max(times[step]["issued_at"][s[name]] for (_, times), s in zip(stats, slots, strict=True))
            spans.append((start, max(start, min(ends))))
        if not spans:
            continue
        busy = union_s(spans)
        model = len(spans) * piece_cost(lead["bytes"] / lead["pieces"]) * comm_contention
        steps.append({"step": float(step), "pieces": float(len(spans)), "busy_s": busy, "model_s": model,
                      "excess_per_piece_s": (busy - model) / len(spans)})
    values = sorted(s["excess_per_piece_s"] for s in steps)
    mid = len(values) // 2
    median = None if not values else values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return {"value": None if median is None else max(0.0, median), "steps": steps,
            "how": "median over steps of (union of the pieces' spans, last rank's issue to first rank's landing, "
                   "- pieces x closed form of the mean piece x comm_contention) / pieces, floored at 0"}


def piece_cost_fit(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The network's cost per piece as the slope across piece sizes: ``runs`` are
    :func:`link_excess_from_times` results (``comm_contention`` 1: ``model_s`` is the closed form
    alone) of the same step cut into pieces of two sizes. Per run the median step's busy time,
    closed form and pieces; then ``busy = m × closed + c × pieces`` solved over the two runs: ``c``
    (``value``, floored at 0) is what one more piece holds the network beyond its closed form, ``m``
    (``contention``) what stretches the bytes. One run's excess over its closed form × the
    baseline's ``comm_contention`` (:func:`link_excess_from_times` alone) mixes the two: a
    contention measured high for the step's flat all-reduce leaves no excess at all (measured:
    2 × 2 ranks on 2 cores, gpt2 and comm-heavy 0 where balanced, on the same links, read 2.2 ms; the
    bench's own rank-0 spans grew 3–4 ms for each piece more). ``None`` when a run has no step or
    both cut the step into as many pieces (no slope to fit), or where the fit's stretch ``m`` comes out at 0
    or below: the busy time grew with the pieces while the closed forms barely moved, so the slope took all of
    it (measured: 4 ranks on 2 cores, compute-heavy, 20 and 40 pieces of 0.111 and 0.126 s closed form busy
    0.220 and 0.445 s: m -0.06 and 11.3 ms a piece, which predicted fifo and dynamic 16-22 % slow; the
    profile then uses one run's excess, 1.8 ms, as where no slope is fitted)."""
    rows = []
    for run in runs:
        steps = run.get("steps") or []
        if not steps:
            return {"value": None, "contention": None, "runs": rows, "how": "a run without a step every rank recorded"}
        rows.append({"pieces": statistics.median(s["pieces"] for s in steps),
                     "busy_s": statistics.median(s["busy_s"] for s in steps),
                     "model_s": statistics.median(s["model_s"] for s in steps), "steps": len(steps)})
    if len(rows) != 2:
        raise ValueError(f"piece_cost_fit needs two runs (two piece sizes), got {len(rows)}")
    (n1, b1, k1), (n2, b2, k2) = ((r["pieces"], r["busy_s"], r["model_s"]) for r in rows)
    det = k1 * n2 - k2 * n1
    if n1 == n2 or abs(det) <= 1e-12 * max(k1 * n2, k2 * n1, 1e-300):
        return {"value": None, "contention": None, "runs": rows, "how": "both runs had as many pieces a step"}
    m = (b1 * n2 - b2 * n1) / det
    c = (k1 * b2 - k2 * b1) / det
    if m <= 0:
        # bytes moved in no time: the slope took all of the busy time (the closed forms of the two runs
        # barely differ while the busy time doubled), so it says nothing about what one piece more costs
        return {"value": None, "fitted_s": c, "contention": m, "runs": rows,
                "how": "the fit's stretch of the bytes came out at 0 or below: no slope to trust"}
    return {"value": max(0.0, c), "fitted_s": c, "contention": m, "runs": rows,
            "how": "busy = m x closed form + c x pieces over the median steps of two runs with pieces of two "
                   "sizes (union of the pieces' spans, last rank's issue to first rank's landing); c floored at 0"}


def start_skew_from_times(ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How far behind the first rank the last one starts a step's communication, from every rank's
    ``Scheduler.stats()`` (``per_step`` and ``issue_times``, one clock: ranks of one machine). Per
    step, the piece some rank issued first (at the start of backward, nothing of the step before is
    in flight): the last rank's issue of it minus the first rank's. Every rank must issue each piece
    before it can move, so the network waits that long for the slowest rank, and the rest of the
    step's pieces with it. ``value``: the mean over steps (``median`` beside it); ``None`` without a
    step every rank recorded. :func:`pooled_start_skew` pools several runs. ``commsched profile``
    keeps it per algorithm in ``meta.start_skew``; the two-level one is ``Profile.two_level_skew_s``.
    The flat one stays a diagnostic: as a delay of every flat piece it made the simulator's
    predictions worse (docs/simulator.md, "Two-level phases and the ranks' start skew")."""
    if not ranks:
        raise ValueError("start_skew_from_times needs the stats of at least one rank")
    stats = _by_step(ranks)
    steps = []
    for step in stats[0][0]:
        if any(step not in per or step not in times for per, times in stats):
            continue
        issued = [dict(zip(per[step].get("order") or (), times[step].get("issued_at") or (), strict=False))
                  for per, times in stats]
        common = [n for n in issued[0] if all(n in i and i[n] is not None for i in issued)]
        if not common:
            continue
        first = min(common, key=lambda n: min(i[n] for i in issued))
        starts = [i[first] for i in issued]
        steps.append({"step": float(step), "piece": first, "skew_s": max(starts) - min(starts),
                      "last_rank": starts.index(max(starts))})
    return _skew_summary(steps)


def pooled_start_skew(runs: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """:func:`start_skew_from_times` over the steps of several runs (each: every rank's stats) together."""
    return _skew_summary([s for ranks in runs for s in start_skew_from_times(ranks)["steps"]])


def _skew_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    values = [s["skew_s"] for s in steps]
    return {"value": statistics.fmean(values) if values else None,
            "median": statistics.median(values) if values else None, "steps": steps,
            "how": "mean over steps of the last rank's issue of the step's first piece minus the first rank's (the "
                   "step's cost grows with it where the network is the bottleneck, so the mean, not the median)"}


def two_level_phase_steps(ranks: Sequence[dict[str, Any]], ranks_per_node: int,
                          phase_cost: Callable[[str, float], float]) -> dict[str, list[dict[str, float]]]:
    """Per phase of a two-level piece, per step: how long the phase's link had a piece, against the
    closed form. ``ranks``: every rank's record of one run with every piece two-level, in rank order,
    each ``{"phases": {phase: [[name, step, handed, issued, landed], ...]}, "per_step":
    Scheduler.stats()["per_step"]}`` (one clock: ranks of one machine). The intra-node phases (the
    reduce-scatter, the all-gather) run on node 0's link among its ranks ``0 .. r-1``; the inter-node
    all-reduce on the network, which the ``r`` groups of one local rank each (``l, l+r, l+2r, ...``)
    share at once, one shard each. A piece's phase in a group runs from the last issue among the
    group's ranks to the first landing; per step the union of those spans over the phase's groups
    (``busy_s``) against ``pieces`` × ``phase_cost(phase, mean piece bytes)`` (``model_s``: the phase of
    the whole piece, every shard): the rows :func:`piece_cost_fit` takes, per phase."""
    if not ranks or ranks_per_node < 1 or len(ranks) % ranks_per_node:
        raise ValueError(f"two_level_phase_steps needs every rank's record ({len(ranks)} given) on nodes of "
                         f"{ranks_per_node} rank(s)")
    node0 = [list(range(ranks_per_node))]
    groups = {"reduce_scatter": node0, "all_gather": node0,
              "all_reduce": [list(range(local, len(ranks), ranks_per_node)) for local in range(ranks_per_node)]}
    per_step = {str(k): v for k, v in (ranks[0].get("per_step") or {}).items()}
    # per rank and phase: (step, name) -> (issued, landed)
    times = [{phase: {(str(st), name): (issued, landed) for name, st, _handed, issued, landed in
                      (r.get("phases") or {}).get(phase, ()) if st is not None and landed is not None}
              for phase in TWO_LEVEL_PHASES} for r in ranks]
    out: dict[str, list[dict[str, float]]] = {}
    for phase in TWO_LEVEL_PHASES:
        rows = []
        for step, lead in sorted(per_step.items(), key=lambda kv: float(kv[0])):
            if not lead.get("pieces"):
                continue
            spans, pieces = [], 0
            for name in lead.get("order") or ():
                key = (step, name)
                if any(key not in times[i][phase] for group in groups[phase] for i in group):
                    continue
                pieces += 1
                for group in groups[phase]:
                    start = max(times[i][phase][key][0] for i in group)
                    spans.append((start, max(start, min(times[i][phase][key][1] for i in group))))
            if not pieces:
                continue
            rows.append({"step": float(step), "pieces": float(pieces), "busy_s": union_s(spans),
                         "model_s": pieces * phase_cost(phase, lead["bytes"] / lead["pieces"])})
        out[phase] = rows
    return out


def two_level_phase_fit(runs: Sequence[dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    """``Profile.two_level_phases`` from two runs' :func:`two_level_phase_steps` (pieces of two sizes):
    per phase :func:`piece_cost_fit`'s ``busy = stretch × closed + per_piece × pieces``. A phase whose
    fit has no slope, or whose stretch comes out at 0 or below (the two runs' noise larger than what
    sets them apart), is priced from both runs pooled as busy per closed form alone (``per_piece_s``
    0); a negative ``per_piece_s`` is floored at 0 the same way. ``value``: the phases priced, ``None``
    where a run recorded no step of some phase."""
    if len(runs) != 2:
        raise ValueError(f"two_level_phase_fit needs two runs (two piece sizes), got {len(runs)}")
    value: dict[str, tuple[float, float]] = {}
    fits: dict[str, Any] = {}
    for phase in TWO_LEVEL_PHASES:
        rows = [run.get(phase) or [] for run in runs]
        if not all(rows):
            return {"value": None, "phases": fits, "how": f"a run recorded no step of the {phase} phase"}
        fit = piece_cost_fit([{"steps": r} for r in rows])
        fits[phase] = fit
        m, c = fit.get("contention"), fit.get("fitted_s")
        if m is not None and c is not None and m > 0 and c >= 0:
            value[phase] = (m, c)
            continue
        busy = sum(statistics.median(s["busy_s"] for s in r) for r in rows)
        model = sum(statistics.median(s["model_s"] for s in r) for r in rows)
        if model > 0 and busy > 0:
            value[phase] = (busy / model, 0.0)
            fit["pooled_stretch"] = busy / model
    return {"value": value or None, "phases": fits,
            "how": "per phase busy = stretch x closed form + per_piece x pieces over the median steps of two runs "
                   "with every piece two-level and pieces of two sizes (union of the spans on the links the phase "
                   "holds, last issue to first landing in each group); busy / closed form of both runs pooled where "
                   "the fit has no slope, a "
                   "stretch <= 0 or a negative per-piece cost"}


def steal_share(ranks: int, cores: int) -> float:
    """How much of commsched's thread CPU a rank's compute pays, with ``ranks`` ranks on a machine
    of ``cores`` cores. Every core busy with a rank's compute (``ranks >= cores``): all of it,
    and ``ranks / cores`` times over (each core is shared by that many ranks, so a CPU second
    taken from it stretches each rank's compute by that factor, as their compute measured side
    by side already is). Two or more cores per rank: none (the threads run beside the compute).
    In between: linear."""
    if ranks < 1 or cores < 1:
        raise ValueError(f"steal_share needs ranks >= 1 and cores >= 1, got ranks={ranks}, cores={cores}")
    per_core = ranks / cores
    return per_core if per_core >= 1.0 else max(0.0, 2.0 * per_core - 1.0)


def check_schema(data: Any, schema: str, kind: str, how: str) -> None:
    """Refuse (``ValueError``) a document that is not a dict of ``schema``; ``how`` says how to make one."""
    if not isinstance(data, dict) or data.get("schema") != schema:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"not a commsched {kind} (schema {got!r}, expected {schema!r}); {how}")


def write_json(document: dict[str, Any], path: str) -> None:
    """``document`` as indented JSON at ``path``."""
    with open(path, "w") as fh:
        json.dump(document, fh, indent=1)


def read_json(path: str) -> Any:
    """The JSON document at ``path``; a ``ValueError`` naming the file when it is not JSON."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); is it truncated?") from None


def load_json(path: str, from_dict: Any) -> Any:
    """``from_dict`` of the JSON at ``path``; every ``ValueError`` (bad JSON, schema, field) names the file."""
    data = read_json(path)
    try:
        return from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
