"""The training-loop strategies the benchmark compares, behind one interface.

=================  =========================================================
name               what runs
=================  =========================================================
``ddp``            DistributedDataParallel, default 25 MB buckets
``ddp:<mb>``       DistributedDataParallel, ``bucket_cap_mb=<mb>``
``horovod``        ``hvd.DistributedOptimizer`` with Horovod's defaults
``fifo``           commsched, backward order, partition and credit off
``reducer[:<mb>]`` commsched's optimizer, every gradient reduced by torch's own C++
                   reducer (DDP's) in ``<mb>`` buckets (default 25): what ``auto`` may choose
``dynamic``        commsched, rank 0 decides the order as pieces get ready
``static``         commsched, order fixed from the first profiled step
``planned``        commsched running a plan rank 0 makes at start (profile of the
                   workload, cached; the bench's emulated topology; ``make_plan``)
``auto``           commsched's online tuner (``ordering="auto"``) on the bench's emulated
                   topology; it spends its first steps tuning (``--warmup`` should cover
                   them: docs/tuning.md)
``hierarchical``   commsched ``dynamic`` with every piece reduced by the two-level
                   algorithm on the bench's nodes (the algorithm's gain alone)
``slack``          commsched ``dynamic`` ranked by the seed's slack rule
                   (``priority="slack"``) on the bench's emulated topology (docs/tuning.md)
``allreduce``      backward, then one flat all-reduce (no overlap at all)
=================  =========================================================

Every strategy averages gradients over ranks and leaves the user's optimizer
to do the update. A strategy that cannot run here (its package is missing)
raises :class:`StrategyUnavailable` with a message that says why.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from commsched.plugins.horovod_gloo import horovod_gloo_rendezvous
from commsched.bench.spec import StrategySpec, parse_strategies
# UNLIMITED_BYTES: with pieces and credit this big, commsched neither cuts tensors nor holds any back,
# i.e. it only keeps the backward (FIFO) order
from commsched.tuner import UNLIMITED_BYTES
from torch import nn

__all__ = ["StrategySpec", "StrategyUnavailable", "make_strategy", "parse_strategies", "unavailable_reason"]


class StrategyUnavailable(RuntimeError):
    """The strategy's package is not importable here; the message says why."""


class Strategy:
    """One training setup: the module to call forward on, and the optimizer calls.

    ``step()`` may return before communication ends (commsched);
    ``synchronize()`` waits for all of it. ``bubble_per_step()`` returns the
    time each measured step blocked on communication, or ``None`` when the
    runner must estimate it (see ``bubble_method``).
    """

    bubble_method = "estimated by the runner"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        """Clear gradients before the next backward."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Apply the averaged gradients (possibly asynchronously)."""
        self.optimizer.step()

    def synchronize(self) -> None:
        """Wait until every update issued so far has landed."""

    def mark_measured(self) -> None:
        """The next step is the first measured one (warm-up is over)."""

    def bubble_per_step(self) -> list[float] | None:
        """Blocked seconds per measured step, if the strategy can tell."""
        return None

    def stats(self) -> dict[str, Any]:
        """Strategy-specific numbers for the JSON report."""
        return {}

    def close(self) -> None:
        """Release background threads and hooks."""


class DDPStrategy(Strategy):
    """``DistributedDataParallel``; blocks inside ``backward()`` until all
    buckets are reduced, so its bubble is estimated from backward times."""

    bubble_method = ("backward() under DDP minus backward() measured while an all-reduce "
                     "ran (baseline); DDP blocks inside backward until every bucket is reduced")

    def __init__(self, model: nn.Module, make_opt: Callable, bucket_mb: float | None) -> None:
        kwargs = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
        ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
        super().__init__(ddp, make_opt(ddp.parameters()))


class AllreduceStrategy(Strategy):
    """Backward, then one all-reduce of all gradients flattened: compute + comm."""

    bubble_method = "duration of the flat all-reduce in step()"

    def __init__(self, model: nn.Module, make_opt: Callable) -> None:
        super().__init__(model, make_opt(model.parameters()))
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._world = dist.get_world_size()
        self._bubbles: list[float] = []

    def step(self) -> None:
        t0 = time.perf_counter()
        grads = [p.grad for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(self._world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        self._bubbles.append(time.perf_counter() - t0)
        self.optimizer.step()

    def mark_measured(self) -> None:
        self._bubbles.clear()

    def bubble_per_step(self) -> list[float]:
        return list(self._bubbles)


class HorovodStrategy(Strategy):
    """``hvd.DistributedOptimizer`` with defaults; ``step()`` waits for all
    outstanding all-reduces, so its bubble is estimated from step() times."""

    bubble_method = ("step() under Horovod minus the plain optimizer step (baseline); "
                     "hvd.DistributedOptimizer.step() waits for every outstanding all-reduce")

    def __init__(self, model: nn.Module, make_opt: Callable, hvd: Any) -> None:
        self._hvd = hvd
        opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        super().__init__(model, opt)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def close(self) -> None:
        self._hvd.shutdown()


class CommschedStrategy(Strategy):
    """commsched's ``DistributedOptimizer`` with the torch.distributed backend."""

    bubble_method = "commsched opt.stats() (time forward or step() blocked on communication)"

    def __init__(self, model: nn.Module, make_opt: Callable, ordering: str,
                 partition_bytes: int, credit_bytes: int, timeline: str | None, *,
                 plan: str | None = None, hierarchical: tuple[int, int] | None = None,
                 topology: Any = None, priority: str = "layer", cross_iteration: bool = True,
                 split_tied: bool = False, fusion_bytes: int | None = None, decide_ahead: bool = True,
                 reducer_bytes: int | None = None, ready_reports: bool = True,
                 thread_nice: int | None = None, verify_order: bool = True, direct_start: bool = False) -> None:
        try:
            import commsched
            from commsched.plugins.torch import DistributedOptimizer
        except ImportError as exc:
            raise StrategyUnavailable(
                f"commsched's PyTorch plugin is not importable ({exc}); "
                "run ddp/horovod only, or install commsched with its torch plugin"
            ) from exc
        if ordering == "fifo":
            partition_bytes = credit_bytes = UNLIMITED_BYTES
        chosen = {} if fusion_bytes is None else {"fusion_bytes": fusion_bytes}  # +fuse=<size>; else the default
        if thread_nice is not None:  # +nice=<n>; else the default
            chosen["thread_nice"] = thread_nice
        config = commsched.SchedulerConfig(
            partition_bytes=partition_bytes, credit_bytes=credit_bytes, ordering=ordering,
            cross_iteration=cross_iteration, timeline=timeline, plan=plan, priority=priority,
            decide_ahead=decide_ahead, ready_reports=ready_reports, verify_order=verify_order,
            direct_start=direct_start, **chosen,
        )
        opt = DistributedOptimizer(make_opt(model.parameters()), model, backend="torch",
                                   config=config, topology=topology, split_tied_embeddings=split_tied)
        if hierarchical is not None:  # every rank, before the first piece: it creates process groups
            opt._backend.use_hierarchical(*hierarchical, every_piece=True)
        super().__init__(model, opt)
        self._first_measured_step = 0
        self._steps = 0
        self._reducer_bytes = reducer_bytes  # ``reducer``: torch's reducer from the second step on (a warm-up one)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()
        self._steps += 1
        if self._steps == 1 and self._reducer_bytes:  # the first step learned the order of first use
            self.optimizer._start_reducer(self._reducer_bytes)

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def mark_measured(self) -> None:
        self._first_measured_step = self._steps

    def stats(self) -> dict[str, Any]:
        return _jsonable(self.optimizer.stats())

    def bubble_per_step(self) -> list[float] | None:
        per_step = bubble_list(self.optimizer.stats())
        if per_step is None:
            return None
        # The list may include warm-up steps; the measured ones are the last n.
        n = self._steps - self._first_measured_step
        return per_step[-n:] if n > 0 else []

    def close(self) -> None:
        self.optimizer.close()


class PlannedStrategy(CommschedStrategy):
    """commsched with ``ordering="planned"``: rank 0 makes the plan at start, every rank runs it.

    Rank 0 takes the workload's profile (:func:`commsched.plugins.torch.profiler.load_or_profile`
    with the bench's flags: cached after the first time, else measured on a cluster of its
    own), the topology ``commsched probe`` last measured for these flags (cached; else the
    bench's emulated topology, :meth:`Topology.emulated`), and searches a plan
    (:func:`commsched.costmodel.planner.make_plan`, at most :data:`PLAN_TIME_LIMIT_S`); it
    writes ``<run_dir>/plan.json`` and posts its digest (or why it failed) to the rendezvous
    store, where the other ranks wait for it (up to the phase timeout: profiling can take
    minutes, longer than a collective's timeout). ``stats()`` records the plan's path, digest
    and predicted step for the report, and on rank 0 the plan itself (``plan_file["plan"]``):
    the run directory is deleted after a good run, and a plan that ran slow must stay readable.
    """

    def __init__(self, model: nn.Module, make_opt: Callable, run_spec: dict, rank: int,
                 timeline: str | None, split_tied: bool = False, decide_ahead: bool = True,
                 ready_reports: bool = True, thread_nice: int | None = None, verify_order: bool = True,
                 order: str | None = None, direct_start: bool = False) -> None:
        path = os.path.join(run_spec["run_dir"], "plan.json")
        self.plan_info = _shared_plan(run_spec, rank, path, split_tied, order)
        self._rank = rank
        super().__init__(model, make_opt, "planned", run_spec["partition_bytes"], run_spec["credit_bytes"],
                         timeline, plan=path, split_tied=split_tied, decide_ahead=decide_ahead,
                         ready_reports=ready_reports, thread_nice=thread_nice, verify_order=verify_order,
                         direct_start=direct_start)

    def stats(self) -> dict[str, Any]:
        info = dict(self.plan_info)
        if self._rank == 0:
            import json

            with open(info["path"], encoding="utf-8") as fh:
                info["plan"] = json.load(fh)
        return dict(super().stats(), plan_file=info)


#: The planner's search budget in the benchmark (seconds of MILP after the greedy grid).
PLAN_TIME_LIMIT_S = 20.0
_PLAN_KEY = "commsched/bench/plan"


def _shared_plan(run_spec: dict, rank: int, path: str, split_tied: bool = False,
                 order: str | None = None) -> dict[str, Any]:
    """Rank 0 makes the plan and writes it to ``path``; every rank returns what rank 0 posted."""
    import json

    from commsched.plugins.torch.backends import default_store

    store = default_store()
    wait_s = float(run_spec.get("phase_timeout_s", 900.0))
    if rank == 0:
        try:
            info = _make_bench_plan(run_spec, path, split_tied, order)
        except Exception as exc:  # noqa: BLE001 - every rank must hear why, then fail
            info = {"error": f"{type(exc).__name__}: {exc}"}
        store.set(_PLAN_KEY, json.dumps(info).encode())
    else:
        info = json.loads(store.get(_PLAN_KEY, wait_s).decode())
    if "error" in info:
        raise RuntimeError(f"rank 0 could not make the plan: {info['error']}")
    return info


def _make_bench_plan(run_spec: dict, path: str, split_tied: bool = False, order: str | None = None) -> dict[str, Any]:
    """The plan of ``planned`` (``split_tied``: of ``planned+tied``, made from the profile with its tied
    embeddings split, :meth:`~commsched.costmodel.profile.Profile.with_tied_split`, as that run's step
    has them; ``order``: of ``planned+order=<order>``, the same plan with its pieces in that order,
    :func:`~commsched.costmodel.planner.with_order`)."""
    from commsched.costmodel.topology import Topology
    from commsched.plugins.torch.profiler import load_or_profile

    try:
        from commsched.costmodel.planner import make_plan, with_order
    except ImportError as exc:
        raise StrategyUnavailable(f"the planner is not importable ({exc})") from exc
    workers, nodes = run_spec["world_size"], run_spec["nodes"]
    bandwidth = run_spec.get("bandwidth")
    intra = run_spec.get("intra_bandwidth")
    started = time.monotonic()
    profile = load_or_profile(run_spec["workload"], batch_size=run_spec["batch_size"], workers=workers, nodes=nodes,
                              bandwidth=bandwidth, intra_bandwidth=intra,
                              network=run_spec.get("network", "netns"), seed=run_spec["seed"])
    from commsched.plugins.torch.probe import cached_probe

    # the links as `commsched probe` measured them for these flags (the real engine's α and its own
    # cost beyond α-β), else the configured emulation (α assumed)
    topology = cached_probe(workers, nodes, bandwidth, intra, run_spec.get("network", "netns"))
    topology_source = "probe (cached)" if topology is not None else "emulated (configured; run commsched probe)"
    if topology is None:
        topology = Topology.emulated(workers, nodes, bandwidth or "none", intra)
    # a cached profile measured when the machine computed faster or slower than now: scaled to the compute
    # this run's baseline measured (the same baseline the profiler took), so the plan and its prediction
    # are for today's machine (measured 2026-12-05: 16-31 % drift, predictions -14..-24 % unscaled,
    # -2.5..-8.4 % scaled; docs/planner.md)
    drift = profile.drift(run_spec.get("baseline_compute_s"))
    if drift is not None:
        profile = profile.scaled(compute=1.0 + drift)
    if split_tied:
        profile = profile.with_tied_split()
    profiled = time.monotonic()
    plan = make_plan(profile, topology, time_limit_s=PLAN_TIME_LIMIT_S).plan
    if order is not None:  # the planner's own order and digest stay in plan.predicted["order_forced"]
        plan = with_order(plan, profile, topology, order)
    tmp = f"{path}.tmp"
    plan.to_json(tmp)
    os.replace(tmp, path)
    return {"path": path, "digest": plan.digest, "predicted": dict(plan.predicted),
            "groups": len(plan.groups), "pieces": len(plan.pieces), "credit_bytes": plan.credit_bytes,
            "algorithms": sorted({p.algorithm for p in plan.pieces}), "order": plan.order,
            "engine": plan.engine, "bucket_bytes": plan.bucket_bytes,
            "profile_s": profiled - started, "plan_s": time.monotonic() - profiled,
            "topology": topology_source, "topology_describe": topology.describe(),
            "tied_split": list(profile.meta.get("tied_split", [])), "profile_drift": drift}


def bubble_list(stats: Any) -> list[float] | None:
    """Per-step bubble seconds from commsched's ``opt.stats()``, whatever its shape.

    Accepts ``{"bubble_s": [..]}`` (per step) and a few spellings close to it;
    ``None`` when stats carry no per-step bubble.
    """
    if not isinstance(stats, dict):
        return None
    for key in ("bubble_s", "bubble", "bubble_per_step_s", "bubbles_s"):
        value = stats.get(key)
        if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
            return [float(v) for v in value]
    for value in stats.values():  # nested, e.g. {"steps": {"bubble_s": [...]}}
        if isinstance(value, dict):
            found = bubble_list(value)
            if found is not None:
                return found
    return None


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return repr(obj)


def init_horovod(spec: dict, rank: int) -> Any:
    """``import horovod.torch`` and ``hvd.init()`` through a gloo rendezvous.

    Follows ``horovodrun --gloo`` (:func:`commsched.plugins.horovod_gloo.horovod_gloo_rendezvous`):
    rank 0 hosts the rendezvous server inside its own node; every rank sets the
    ``HOROVOD_*`` variables horovodrun would set and calls ``hvd.init()``.
    """
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise StrategyUnavailable(
            f"horovod is not importable ({exc}); to include it, install Horovod built with PyTorch and gloo:"
            " HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 pip install --no-build-isolation horovod"
        ) from exc
    env = horovod_gloo_rendezvous(
        rank=rank, world_size=spec["world_size"], nodes=spec["nodes"], run_dir=spec["run_dir"],
        master_addr=spec["master_addr"], ifname=spec["ranks"][rank]["ifname"],
    )
    os.environ.update(env)
    hvd.init()
    return hvd


def make_strategy(spec: StrategySpec, model: nn.Module, make_opt: Callable, *,
                  run_spec: dict, rank: int, timeline: str | None) -> Strategy:
    """Build ``spec``'s strategy around ``model``; may raise :class:`StrategyUnavailable`."""
    strategy = _make_strategy(spec, model, make_opt, run_spec=run_spec, rank=rank, timeline=timeline)
    if spec.whole_apply and isinstance(strategy, CommschedStrategy):
        strategy.optimizer._ranged = False  # +whole: no ranged apply (the bench's A/B of it; no public switch)
    return strategy


def _make_strategy(spec: StrategySpec, model: nn.Module, make_opt: Callable, *,
                   run_spec: dict, rank: int, timeline: str | None) -> Strategy:
    # every commsched strategy's modifiers: +tied (split tied embeddings), +fuse=<size> (its own fusion
    # threshold; not on planned, whose plan fixes its groups), +noahead (rank 0 publishes each decision
    # as its piece starts), +noreports (rank 0 decides on its own readiness), +nice=<n> (commsched's threads
    # below the training thread's CPU priority), +noverify (no check of each fifo step's order) and +direct (a
    # completion, on gloo's thread, or a delivered decision starts what it freed itself)
    mods = {"split_tied": spec.split_tied, "fusion_bytes": spec.fusion_bytes, "decide_ahead": spec.decide_ahead,
            "ready_reports": spec.ready_reports, "thread_nice": spec.thread_nice, "verify_order": spec.verify_order,
            "direct_start": spec.direct_start}
    if spec.kind == "ddp":
        return DDPStrategy(model, make_opt, spec.bucket_mb)
    if spec.kind == "allreduce":
        return AllreduceStrategy(model, make_opt)
    if spec.kind == "horovod":
        return HorovodStrategy(model, make_opt, init_horovod(run_spec, rank))
    if spec.kind == "planned":
        return PlannedStrategy(model, make_opt, run_spec, rank, timeline, split_tied=spec.split_tied,
                               decide_ahead=spec.decide_ahead, ready_reports=spec.ready_reports,
                               thread_nice=spec.thread_nice, verify_order=spec.verify_order,
                               order=spec.plan_order, direct_start=spec.direct_start)
    if spec.kind in ("auto", "slack"):  # the tuner's start point and the slack rule see the emulated network
        from commsched.costmodel.topology import Topology

        topology = Topology.emulated(run_spec["world_size"], run_spec["nodes"], run_spec.get("bandwidth") or "none",
                                     run_spec.get("intra_bandwidth"))
        if spec.kind == "slack":
            return CommschedStrategy(model, make_opt, "dynamic", run_spec["partition_bytes"],
                                     run_spec["credit_bytes"], timeline, topology=topology, priority="slack", **mods)
        return CommschedStrategy(model, make_opt, "auto", run_spec["partition_bytes"], run_spec["credit_bytes"],
                                 timeline, topology=topology, **mods)
    if spec.kind == "reducer":  # torch's reducer under commsched's optimizer: DDP's engine, commsched's API
        return CommschedStrategy(model, make_opt, "fifo", UNLIMITED_BYTES, UNLIMITED_BYTES, timeline,
                                 cross_iteration=False, reducer_bytes=int((spec.bucket_mb or 25) * (1 << 20)),
                                 **mods)
    if spec.kind == "sync":  # fifo on the synchronous path: one piece per fused group, step() waits
        return CommschedStrategy(model, make_opt, "fifo", UNLIMITED_BYTES, UNLIMITED_BYTES, timeline,
                                 cross_iteration=False, **mods)
    # dynamic:<partition>/<credit>, hierarchical:<...> (a grid point): its own sizes; else the run's
    # --partition-mb/--credit-mb
    partition = spec.partition_bytes if spec.partition_bytes is not None else run_spec["partition_bytes"]
    credit = spec.credit_bytes if spec.credit_bytes is not None else run_spec["credit_bytes"]
    if spec.kind == "hierarchical":
        nodes = run_spec["nodes"]
        return CommschedStrategy(model, make_opt, "dynamic", partition, credit, timeline,
                                 hierarchical=(nodes, run_spec["world_size"] // nodes), **mods)
    return CommschedStrategy(model, make_opt, spec.kind, partition, credit, timeline, **mods)


def unavailable_reason(spec: StrategySpec) -> str | None:
    """Why ``spec`` cannot run in this environment, or ``None`` if it may.

    Checked by the runner before it starts any worker for the strategy; the
    workers check again (and report a skip) for failures only an import shows.
    """
    if spec.kind == "horovod":
        if importlib.util.find_spec("horovod") is None:
            return ("horovod is not installed (import horovod.torch fails); to include it, install "
                    "Horovod built with PyTorch and gloo (`make horovod` in the repository)")
    elif spec.is_commsched:
        try:
            from commsched.plugins.torch import DistributedOptimizer  # noqa: F401
        except ImportError as exc:
            return (f"commsched's PyTorch plugin is not importable ({exc}); "
                    "install commsched with its torch plugin")
    return None
