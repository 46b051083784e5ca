"""Parsing the workload benchmark's ``--strategies`` (no framework import: the CLI parses before any worker runs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from commsched.config import parse_fusion, parse_nice, parse_size
from commsched.plan import ORDERS
from commsched.tuner import UNLIMITED_BYTES  # what ``none`` means in ``dynamic:<partition>/<credit>``

#: The strategies whose piece size and credit a strategy name may set: ``dynamic:1MiB/4MiB`` (a point
#: of a grid search over piece size x credit, to compare ``auto`` with: docs/tuning.md), and
#: ``hierarchical:4MiB/16MiB`` (two-level pieces of two sizes side by side in one run: docs/planner.md)
SIZED_KINDS = ("dynamic", "static", "hierarchical")

#: ``auto``: the online tuner (``SchedulerConfig(ordering="auto")``; it needs steps to tune: docs/tuning.md)
COMMSCHED_ORDERINGS = ("fifo", "dynamic", "static", "planned", "auto")
#: commsched strategies: the orderings, ``hierarchical`` (``dynamic`` with every piece
#: reduced by the two-level algorithm, to attribute the algorithm's gain alone) and ``slack``
#: (``dynamic`` ranked by the seed's slack rule, ``priority="slack"``) and ``sync`` (``fifo`` on the
#: synchronous path, ``cross_iteration=False``: ``step()`` waits for every reduction and runs the
#: wrapped optimizer once, as DDP does; the setting for where communication is already hidden) and
#: ``reducer[:<MB>]`` (commsched's optimizer handing every gradient to torch's own C++ reducer, DDP's, with
#: buckets of that size, default 25: the engine ``auto`` may choose where communication is hidden)
COMMSCHED_KINDS = (*COMMSCHED_ORDERINGS, "hierarchical", "slack", "sync", "reducer")


@dataclass(frozen=True)
class StrategySpec:
    """A parsed ``--strategies`` entry."""

    name: str  # as the user wrote it, e.g. "ddp:4"
    kind: str  # ddp | horovod | fifo | sync | reducer | dynamic | static | planned | auto | hierarchical | slack
    bucket_mb: float | None = None  # ddp:<MB>, reducer:<MB>
    #: ``dynamic:<partition>/<credit>``: this strategy's own piece size and credit in bytes
    #: (``UNLIMITED_BYTES`` for ``none``); None: the run's ``--partition-mb``/``--credit-mb``
    partition_bytes: int | None = None
    credit_bytes: int | None = None
    #: ``<commsched strategy>+tied``: with ``split_tied_embeddings=True`` (PyTorch: a tied embedding's
    #: projection part reduced as soon as backward made it, its lookup part exchanged as rows)
    split_tied: bool = False
    #: ``<commsched strategy>+whole``: every gradient applied whole after its last piece, never range by range
    #: as its pieces land (PyTorch's ranged apply off): what ranged apply gains, side by side
    whole_apply: bool = False
    #: ``<commsched strategy>+fuse=<size>``: this strategy's own ``fusion_bytes`` (runs of small gradients
    #: fused into one task up to that size; ``0`` none); None: ``SchedulerConfig``'s default
    fusion_bytes: int | None = None
    #: ``<commsched strategy>+noahead``: ``SchedulerConfig(decide_ahead=False)``, rank 0 publishes each
    #: decision as the piece starts, never an ended step's rest at once: what deciding ahead gains, side by side
    decide_ahead: bool = True
    #: ``<commsched strategy>+noreports``: ``SchedulerConfig(ready_reports=False)``, rank 0 decides on its own
    #: readiness, not on every rank's: what the followers' ready reports gain, side by side
    ready_reports: bool = True
    #: ``<commsched strategy>+nice=<n>``: ``SchedulerConfig(thread_nice=n)``, commsched's threads that much below
    #: the training thread in CPU priority; None: the config's default. What that gains, side by side
    thread_nice: int | None = None
    #: ``<commsched strategy>+noverify``: ``SchedulerConfig(verify_order=False)``, no check of each fifo step's
    #: order after it (:mod:`commsched.order_check`): what that check costs, side by side
    verify_order: bool = True
    #: ``<commsched strategy>+direct``: ``SchedulerConfig(direct_start=True)``, a piece's completion (on gloo's
    #: thread) and a delivered decision or ready report (on the order thread) start what they freed themselves,
    #: without waking the dispatch thread: what that thread hop costs, side by side
    direct_start: bool = False
    #: ``planned+order=<fixed|priority|observed>``: the plan's pieces (groups, sizes, algorithms, credit) go in
    #: that order instead of the one the planner chose (:data:`commsched.plan.ORDERS`); None: the planner's.
    #: What the order costs or gains, side by side with the same pieces
    plan_order: str | None = None

    @property
    def is_commsched(self) -> bool:
        """Whether commsched schedules this strategy's communication."""
        return self.kind in COMMSCHED_KINDS


def file_safe(name: str) -> str:
    """``name`` as part of a file name: ``ddp:4`` -> ``ddp_4``, ``dynamic:1MiB/4MiB`` -> ``dynamic_1MiB_4MiB``."""
    return name.replace(":", "_").replace("/", "_")


def _sized(name: str, kind: str, arg: str) -> StrategySpec:
    """``dynamic:<partition>/<credit>`` (sizes as ``SchedulerConfig`` takes them, or ``none``)."""
    part, slash, credit = arg.partition("/")
    if not slash:
        raise ValueError(f"strategy {name!r}: give the piece size and the credit as {kind}:<partition>/<credit>, "
                         f"e.g. {kind}:1MiB/4MiB ('none' for no limit)")

    def size(text: str, what: str) -> int:
        text = text.strip()
        if text.lower() == "none":
            return UNLIMITED_BYTES
        try:
            return parse_size(text, what)
        except ValueError as exc:
            raise ValueError(f"strategy {name!r}: {exc} (or 'none' for no limit)") from None
    return StrategySpec(name, kind, partition_bytes=size(part, "partition"), credit_bytes=size(credit, "credit"))


def parse_strategies(text: str) -> list[StrategySpec]:
    """Parse ``"ddp,ddp:4,horovod,fifo,sync,dynamic,dynamic:1MiB/4MiB,static,auto,planned,hierarchical,slack"``;
    ``ValueError`` on a bad entry."""
    specs = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        base, *modifiers = name.split("+")
        spec = _one(base)
        kinds, fusion = parse_modifiers(name, modifiers, commsched=spec.is_commsched, planned=spec.kind == "planned")
        specs.append(dataclasses.replace(spec, name=name, split_tied="tied" in kinds,
                                         whole_apply="whole" in kinds, fusion_bytes=fusion,
                                         decide_ahead="noahead" not in kinds,
                                         ready_reports="noreports" not in kinds,
                                         verify_order="noverify" not in kinds,
                                         direct_start="direct" in kinds,
                                         thread_nice=_nice(name, modifiers),
                                         plan_order=plan_order_of(name, modifiers)))
    if not specs:
        raise ValueError("no strategy given; e.g. --strategies ddp,ddp:4,dynamic")
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"strategy listed twice in {text!r}")
    return specs


#: The modifiers a commsched strategy's name may end in, and what each does.
MODIFIERS = {
    "tied": "+tied (split tied embeddings)",
    "whole": "+whole (apply gradients whole, not range by range)",
    "fuse": "+fuse=<size> (fuse small gradients up to that size; not on planned, whose plan fixes its groups)",
    "noahead": "+noahead (rank 0 publishes each decision as its piece starts, not an ended step's rest at once)",
    "noreports": "+noreports (rank 0 decides on its own readiness, without the other ranks' ready reports)",
    "nice": "+nice=<n> (commsched's threads n steps below the training thread's CPU priority, 0-19)",
    "noverify": "+noverify (no check of each fifo step's order after it)",
    "direct": "+direct (a completion or a delivered decision starts what it freed itself, not the dispatch thread)",
    "order": "+order=<fixed|priority|observed> (planned only: the plan's pieces in that order, not the planner's)",
}
#: the modifiers that take a value (``+fuse=<size>``, ``+nice=<n>``, ``+order=<order>``)
VALUED = ("fuse", "nice", "order")


def _nice(name: str, modifiers: list[str]) -> int | None:
    """The ``n`` of ``+nice=<n>`` among ``modifiers`` (checked by :func:`parse_modifiers`), else None."""
    for m in modifiers:
        kind, eq, value = m.partition("=")
        if kind == "nice":
            try:
                return parse_nice(value if eq else "", "+nice")
            except ValueError as exc:
                raise ValueError(f"strategy {name!r}: {exc} (e.g. dynamic+nice=10)") from None
    return None


def plan_order_of(name: str, modifiers: list[str]) -> str | None:
    """The order of ``+order=<order>`` among ``modifiers`` (checked by :func:`parse_modifiers`), else None;
    ``ValueError`` naming the strategy for an order :data:`commsched.plan.ORDERS` does not have."""
    for m in modifiers:
        kind, _, value = m.partition("=")
        if kind == "order":
            if value not in ORDERS:
                raise ValueError(f"strategy {name!r}: +order takes one of {', '.join(ORDERS)} "
                                 "(e.g. planned+order=priority)")
            return value
    return None


def parse_modifiers(name: str, modifiers: list[str], *, commsched: bool, planned: bool,
                    allowed: tuple[str, ...] = tuple(MODIFIERS)) -> tuple[frozenset[str], int | None]:
    """The ``+`` modifiers of strategy ``name`` (``modifiers``: what follows its base, split at ``+``):
    which of ``allowed`` it has, and the size of ``+fuse=<size>`` (None without one). ``ValueError``
    naming the strategy: a modifier not allowed, repeated, with a value where it takes none (only
    :data:`VALUED` ones take one), on a strategy commsched does not run, ``+fuse`` on ``planned``, or
    ``+order`` on anything else. The bench and the simulator both read names with it (``commsched
    simulate`` predicts what ``commsched bench`` runs)."""
    kinds = [m.partition("=")[0] for m in modifiers]
    if modifiers and (not commsched or not set(kinds) <= set(allowed) or len(set(kinds)) != len(kinds)
                      or any(m != k and k not in VALUED for m, k in zip(modifiers, kinds, strict=True))
                      or ("fuse" in kinds and planned) or ("order" in kinds and not planned)):
        listed = [MODIFIERS[k] for k in allowed]
        raise ValueError(f"strategy {name!r}: the modifiers are {', '.join(listed[:-1])} and {listed[-1]}, each "
                         "once, on a commsched strategy (e.g. dynamic+tied, fifo+fuse=4MiB, planned+order=priority)")
    fusion = None
    for m in modifiers:
        if m.partition("=")[0] == "fuse":
            _, eq, size = m.partition("=")
            try:
                fusion = parse_fusion(size.strip() if eq else "", "+fuse")
            except ValueError as exc:
                raise ValueError(f"strategy {name!r}: {exc} (e.g. fifo+fuse=4MiB)") from None
    return frozenset(kinds), fusion


def _one(name: str) -> StrategySpec:
    """One ``--strategies`` entry without a modifier."""
    kind, _, arg = name.partition(":")
    if kind in ("ddp", "reducer"):
        mb = None
        if arg:
            try:
                mb = float(arg)
            except ValueError:
                mb = -1.0
            if not (mb > 0 and mb < 1e6):
                raise ValueError(f"strategy {name!r}: bucket size must be a positive "
                                 f"number of MB, e.g. {kind}:4")
        return StrategySpec(name, kind, mb)
    if kind in ("horovod", "allreduce", *COMMSCHED_KINDS) and not arg:
        return StrategySpec(name, kind)
    if kind in SIZED_KINDS:
        return _sized(name, kind, arg)
    raise ValueError(
        f"unknown strategy {name!r}; use ddp, ddp:<bucket MB>, horovod, fifo, sync, reducer, reducer:<bucket MB>, "
        "dynamic, dynamic:<partition>/<credit>, static, auto, planned, hierarchical, "
        "hierarchical:<partition>/<credit>, slack or allreduce "
        "(a commsched one with +tied to split tied embeddings, +whole to apply gradients whole)"
    )
