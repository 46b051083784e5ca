"""A communication plan: what ``ordering="planned"`` executes, fixed before training.

A :class:`Plan` says, for one model on one topology:

* **groups** — the scheduler's tasks. A group is one gradient tensor, or several
  small tensors fused into one flat buffer (copied in when the last of them is
  ready, copied out when it is reduced); each group has its own piece size;
* **pieces** — every piece of every group (``<group>#<index>``, the bounds given by
  :func:`commsched.partition.piece_bounds` of the group's elements at its piece
  size), in the one order every rank issues them, each with its all-reduce
  algorithm (``"ring"``, or ``"hierarchical"``: intra-node reduce-scatter, inter-node
  all-reduce of the shard, intra-node all-gather);
* **credit** — the most bytes in flight, as for the other orderings;
* **order** — ``"fixed"``: every rank issues the pieces in exactly the listed order;
  ``"priority"``: the pieces are the plan's (groups, sizes, algorithms) but the order is
  the runtime's priority order (rank 0 decides as ``dynamic`` does), the listed order
  being what the simulator predicts it to be; ``"observed"``: the plan's pieces, steps 0
  to :data:`OBSERVED_STEP` in the runtime's priority order, and every later step in one
  order rank 0 derives from step :data:`OBSERVED_STEP` (as ``static`` replays step 0: no
  message per step): the priority rule run again over the readiness rank 0 saw in that
  step, on the link of the plan's topology (:func:`commsched.policy.edd_replay_order`;
  the order as issued where the plan has no topology). The planner writes ``"observed"`` (or what
  ``PlanSearch.kept_default_order`` says) where its search found no gain over the runtime
  default: a fixed replay of a *predicted* order holds every piece behind one that is
  ready later than the profile said; the order the ranks really saw does not
  (docs/planner.md, "What the order costs");
* **engine** — ``"commsched"`` (the default): commsched's scheduler runs the groups and pieces
  above; ``"reducer"``: the planner found the communication hidden already behind compute
  under DDP's own shape, so nothing is left to schedule, and the plan names the framework's
  own bucketed reducer (torch's C++ ``Reducer``, DDP's) with buckets of ``bucket_bytes``.
  Its groups and pieces are then DDP's shape inside commsched (small tensors fused up to
  ``bucket_bytes``, one piece each), which a framework or a model the reducer cannot serve
  runs instead (docs/planner.md, "A plan that names DDP's engine");
* **model** — the fingerprint: each parameter's name, element count, element size,
  and (when the profile recorded them) shape and dtype, so a plan made for another
  model is refused before any step, naming the difference;
* **predicted** — the simulator's step time of the plan and of the baselines it
  was compared with, and what the solver reported (status, gap, time).

JSON carries :data:`SCHEMA` and :attr:`Plan.digest`, a hash of everything the ranks
must agree on; the runtime compares it with rank 0's before the first step.
``commsched plan`` (:mod:`commsched.costmodel.planner`) writes plans.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from commsched.errors import CommschedError
from commsched.partition import piece_bounds

__all__ = ["ALGORITHMS", "ENGINES", "OBSERVED_STEP", "ORDERS", "SCHEMA", "Plan", "PlanGroup", "PlanMismatch",
           "PlannedPiece", "PlannedTensor", "fused_name"]

SCHEMA = "commsched-plan/1"
#: All-reduce algorithms a planned piece may name (see :mod:`commsched.costmodel.collectives`).
ALGORITHMS = ("ring", "hierarchical")
#: How the ranks order a plan's pieces: ``fixed`` (the listed order), ``priority`` (the runtime's,
#: rank 0 deciding every step) or ``observed`` (by priority up to :data:`OBSERVED_STEP`, then
#: that step's order every step).
ORDERS = ("fixed", "priority", "observed")
#: What reduces a plan's gradients: ``commsched`` (its scheduler, the plan's pieces) or ``reducer``
#: (the framework's own bucketed reducer, buckets of ``Plan.bucket_bytes``; the pieces where it cannot run).
ENGINES = ("commsched", "reducer")
#: The step whose readiness an ``"observed"`` plan replays. Not step 0: step 0 is a warm-up (the
#: first collectives, the allocator, no forward wait before it), its backward and its
#: communication are paced unlike the steady state's. Step 2 is the bench's last warm-up.
OBSERVED_STEP = 2


class PlanMismatch(CommschedError, ValueError):
    """The plan does not fit this run: another model, another world, or another rank's plan."""


@dataclass(frozen=True)
class PlannedTensor:
    """One parameter's gradient as the plan knows it (the fingerprint's entries)."""

    name: str
    numel: int
    element_size: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    def describe(self) -> str:
        shape = "" if self.shape is None else f" shape {list(self.shape)}"
        dtype = "" if self.dtype is None else f" {self.dtype}"
        return f"{self.numel} elements of {self.element_size} B{shape}{dtype}"


@dataclass(frozen=True)
class PlanGroup:
    """A task of the plan: ``tensors`` (one, or several fused, in this order) cut at ``partition_bytes``."""

    name: str
    tensors: tuple[str, ...]
    partition_bytes: int

    @property
    def fused(self) -> bool:
        return len(self.tensors) > 1


@dataclass(frozen=True)
class PlannedPiece:
    """Piece ``index`` of group ``task``, reduced with ``algorithm``."""

    task: str
    index: int
    algorithm: str = "ring"

    @property
    def name(self) -> str:
        return f"{self.task}#{self.index}"


def fused_name(tensors: Iterable[str]) -> str:
    """The task name of a fusion group: ``fused[<first>..<last>](<count>)``."""
    names = list(tensors)
    return f"fused[{names[0]}..{names[-1]}]({len(names)})"


@dataclass(frozen=True)
class Plan:
    """A versioned, checked communication plan (see the module docstring)."""

    model: tuple[PlannedTensor, ...]
    groups: tuple[PlanGroup, ...]
    pieces: tuple[PlannedPiece, ...]
    credit_bytes: int
    nodes: int = 1
    ranks_per_node: int = 1
    order: str = "fixed"
    engine: str = "commsched"
    #: ``engine="reducer"``: the reducer's bucket size (None with ``engine="commsched"``)
    bucket_bytes: int | None = None
    topology: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    predicted: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        self._check()

    # ------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def fingerprint(self) -> str:
        """sha256 of the model entries (name, numel, element size, shape, dtype), in order."""
        rows = [[t.name, t.numel, t.element_size, None if t.shape is None else list(t.shape), t.dtype]
                for t in self.model]
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()

    @property
    def digest(self) -> str:
        """sha256 of what every rank must agree on: fingerprint, world, groups, pieces, credit, order, engine."""
        body: dict[str, Any] = {
            "fingerprint": self.fingerprint, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
            "credit_bytes": self.credit_bytes,
            "groups": [[g.name, list(g.tensors), g.partition_bytes] for g in self.groups],
            "pieces": [[p.task, p.index, p.algorithm] for p in self.pieces]}
        if self.order != "fixed":  # plans written before the field keep their digest
            body["order"] = self.order
        if self.engine != "commsched":  # so do plans written before this field
            body["engine"] = [self.engine, self.bucket_bytes]
        return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()

    @property
    def piece_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pieces)

    def tensor(self, name: str) -> PlannedTensor:
        return self._tensors[name]

    def group(self, name: str) -> PlanGroup:
        return self._groups[name]

    def group_of(self, tensor: str) -> PlanGroup:
        """The group that carries gradient ``tensor``."""
        return self._groups[self._group_of[tensor]]

    def group_numel(self, group: PlanGroup) -> int:
        return sum(self._tensors[t].numel for t in group.tensors)

    def group_element_size(self, group: PlanGroup) -> int:
        return self._tensors[group.tensors[0]].element_size

    def bounds(self, group: PlanGroup | str) -> list[tuple[int, int]]:
        """The element ranges of the group's pieces (what the runtime cuts)."""
        group = self._groups[group] if isinstance(group, str) else group
        return piece_bounds(self.group_numel(group), self.group_element_size(group), group.partition_bytes)

    def algorithm_of(self, piece_name: str) -> str:
        return self._algorithms[piece_name]

    def piece_bytes(self, piece: PlannedPiece) -> int:
        group = self._groups[piece.task]
        lo, hi = self.bounds(group)[piece.index]
        return (hi - lo) * self.group_element_size(group)

    # ------------------------------------------------------------- checks
    def _check(self) -> None:
        if isinstance(self.credit_bytes, bool) or not isinstance(self.credit_bytes, int) or self.credit_bytes <= 0:
            raise ValueError(f"plan credit_bytes={self.credit_bytes!r} must be a positive integer")
        for key in ("nodes", "ranks_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"plan {key}={value!r} must be a positive integer")
        if self.order not in ORDERS:
            raise ValueError(f"plan order={self.order!r}; known: {', '.join(ORDERS)}")
        if self.engine not in ENGINES:
            raise ValueError(f"plan engine={self.engine!r}; known: {', '.join(ENGINES)}")
        if self.engine == "reducer" and (isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int)
                                         or self.bucket_bytes <= 0):
            raise ValueError(f"plan engine='reducer' needs bucket_bytes, the reducer's bucket size in bytes (> 0); "
                             f"got {self.bucket_bytes!r}")
        if self.engine == "commsched" and self.bucket_bytes is not None:
            raise ValueError(f"plan bucket_bytes={self.bucket_bytes!r} is the reducer's bucket size: only a plan with "
                             "engine='reducer' has one")
        tensors: dict[str, PlannedTensor] = {}
        for t in self.model:
            if t.name in tensors:
                raise ValueError(f"plan: parameter {t.name!r} is listed twice in the model")
            if t.numel < 0 or t.element_size <= 0:
                raise ValueError(f"plan: parameter {t.name!r} has numel={t.numel}, element_size={t.element_size}")
            tensors[t.name] = t
        groups: dict[str, PlanGroup] = {}
        group_of: dict[str, str] = {}
        for g in self.groups:
            if g.name in groups:
                raise ValueError(f"plan: group {g.name!r} is listed twice")
            if not g.tensors:
                raise ValueError(f"plan: group {g.name!r} has no tensors")
            if "#" in g.name or "\t" in g.name or "\n" in g.name:
                raise ValueError(f"plan: group name {g.name!r} may not contain '#', tabs or newlines")
            if isinstance(g.partition_bytes, bool) or not isinstance(g.partition_bytes, int) or g.partition_bytes <= 0:
                raise ValueError(f"plan: group {g.name!r} partition_bytes={g.partition_bytes!r} must be > 0")
            for name in g.tensors:
                if name not in tensors:
                    raise ValueError(f"plan: group {g.name!r} names {name!r}, which is not in the plan's model")
                if name in group_of:
                    raise ValueError(f"plan: tensor {name!r} is in two groups ({group_of[name]!r}, {g.name!r})")
                group_of[name] = g.name
            sizes = {tensors[name].element_size for name in g.tensors}
            if len(sizes) > 1:
                raise ValueError(f"plan: fused group {g.name!r} mixes element sizes {sorted(sizes)}; "
                                 "only tensors of one dtype can share a fusion buffer")
            if len(g.tensors) == 1 and g.name != g.tensors[0]:
                raise ValueError(f"plan: the group of one tensor must carry its name ({g.tensors[0]!r}, "
                                 f"not {g.name!r})")
            groups[g.name] = g
        missing = [t for t in tensors if t not in group_of]
        if missing:
            raise ValueError(f"plan: tensors {missing[:5]} are in no group; every gradient must be planned")
        object.__setattr__(self, "_tensors", tensors)
        object.__setattr__(self, "_groups", groups)
        object.__setattr__(self, "_group_of", group_of)
        algorithms: dict[str, str] = {}
        for p in self.pieces:
            if p.task not in groups:
                raise ValueError(f"plan: piece {p.name!r} belongs to no group")
            if p.algorithm not in ALGORITHMS:
                raise ValueError(f"plan: piece {p.name!r} has algorithm {p.algorithm!r}; "
                                 f"known: {', '.join(ALGORITHMS)}")
            if p.name in algorithms:
                raise ValueError(f"plan: piece {p.name!r} is listed twice")
            algorithms[p.name] = p.algorithm
        # each piece under its group's name (the name before its last '#'), in one pass over the pieces: a scan
        # of every piece per group took ~0.9 s for each plan of a 70B decoder (~720 groups, ~1,000 pieces), half
        # of `commsched advise --model gpt-70b --cluster 16x8`'s 22 s (its greedy grid builds 12 plans)
        named: dict[str, set[str]] = {}
        for name in algorithms:
            named.setdefault(name.rsplit("#", 1)[0], set()).add(name)
        for g in self.groups:
            n = len(self.bounds(g))
            want = {f"{g.name}#{i}" for i in range(n)}
            have = named.get(g.name, set())
            if want != have:
                raise ValueError(f"plan: group {g.name!r} has {n} pieces at {g.partition_bytes} B but the plan "
                                 f"orders {sorted(have)[:5]}; each piece must appear exactly once")
        object.__setattr__(self, "_algorithms", algorithms)

    def check_model(self, parameters: Iterable[PlannedTensor]) -> None:
        """Refuse (``PlanMismatch``) a model that is not the one the plan was made for.

        ``parameters``: this run's gradients. Shape and dtype are compared where both
        sides know them. The message names every difference (up to ten of each kind).
        """
        got = {t.name: t for t in parameters}
        problems: list[str] = []
        missing = [n for n in self._tensors if n not in got]
        extra = [n for n in got if n not in self._tensors]
        if missing:
            problems.append(f"in the plan but not in the model: {missing[:10]}")
        if extra:
            problems.append(f"in the model but not in the plan: {extra[:10]}")
        changed = []
        for name, want in self._tensors.items():
            have = got.get(name)
            if have is None:
                continue
            if (want.numel, want.element_size) != (have.numel, have.element_size) or (
                    want.shape is not None and have.shape is not None and tuple(want.shape) != tuple(have.shape)) or (
                    want.dtype is not None and have.dtype is not None and want.dtype != have.dtype):
                changed.append(f"{name}: plan {want.describe()}, model {have.describe()}")
        if changed:
            problems.append("changed: " + "; ".join(changed[:10]))
        if problems:
            raise PlanMismatch("the plan was made for another model (fingerprint "
                               f"{self.fingerprint[:12]}): " + " | ".join(problems)
                               + ". Make a new plan for this model: `commsched plan --profile P --topology T "
                               "--json plan.json` (profile with `commsched profile` or opt.profile())")

    def check_world(self, world_size: int) -> None:
        """Refuse a plan made for another number of ranks."""
        if world_size != self.world_size:
            raise PlanMismatch(f"the plan is for {self.nodes} node(s) x {self.ranks_per_node} rank(s) = "
                               f"{self.world_size} ranks, but this run has {world_size}; plan again with the "
                               "topology of this run")

    # --------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "digest": self.digest,
            "model": {"fingerprint": self.fingerprint,
                      "parameters": [{"name": t.name, "numel": t.numel, "element_size": t.element_size,
                                      "shape": None if t.shape is None else list(t.shape), "dtype": t.dtype}
                                     for t in self.model]},
            "nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "credit_bytes": self.credit_bytes,
            "order": self.order, "engine": self.engine, "bucket_bytes": self.bucket_bytes,
            "groups": [{"name": g.name, "tensors": list(g.tensors), "partition_bytes": g.partition_bytes}
                       for g in self.groups],
            "pieces": [{"task": p.task, "index": p.index, "algorithm": p.algorithm,
                        "bytes": self.piece_bytes(p)} for p in self.pieces],
            "topology": dict(self.topology), "predicted": dict(self.predicted), "meta": dict(self.meta),
        }

    def to_json(self, path: str) -> None:
        from commsched.costmodel.profile import write_json  # (commsched.costmodel imports this module)

        write_json(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        from commsched.costmodel.profile import check_schema

        check_schema(data, SCHEMA, "plan", "make one with `commsched plan --profile P --topology T --json plan.json`")
        try:
            plan = cls(
                model=tuple(PlannedTensor(p["name"], int(p["numel"]), int(p["element_size"]),
                                          None if p.get("shape") is None else tuple(int(d) for d in p["shape"]),
                                          p.get("dtype")) for p in data["model"]["parameters"]),
                groups=tuple(PlanGroup(g["name"], tuple(g["tensors"]), int(g["partition_bytes"]))
                             for g in data["groups"]),
                pieces=tuple(PlannedPiece(p["task"], int(p["index"]), p.get("algorithm", "ring"))
                             for p in data["pieces"]),
                credit_bytes=int(data["credit_bytes"]), nodes=int(data.get("nodes", 1)),
                ranks_per_node=int(data.get("ranks_per_node", 1)), order=str(data.get("order", "fixed")),
                engine=str(data.get("engine", "commsched")),
                bucket_bytes=None if data.get("bucket_bytes") is None else int(data["bucket_bytes"]),
                topology=dict(data.get("topology", {})),
                predicted=dict(data.get("predicted", {})), meta=dict(data.get("meta", {})))
        except (KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise ValueError(f"the plan is missing or mistypes a field ({exc!r}); see commsched.plan") from None
        stored = data.get("digest")
        if stored is not None and stored != plan.digest:
            raise ValueError(f"the plan's digest {stored[:12]} does not match its content ({plan.digest[:12]}): "
                             "the file was edited by hand or truncated; make it again with `commsched plan`")
        return plan

    @classmethod
    def from_json(cls, path: str) -> "Plan":
        from commsched.costmodel.profile import load_json

        return load_json(path, cls.from_dict)
