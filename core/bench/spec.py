"""Parsing the workload benchmark's ``--strategies`` (no framework import: the CLI parses before any worker runs)."""

from __future__ import annotations

from dataclasses import dataclass

#: ``auto``: the online tuner (``SchedulerConfig(ordering="auto")``; it needs steps to tune: docs/tuning.md)
COMMSCHED_ORDERINGS = ("fifo", "dynamic", "static", "planned", "auto")
#: commsched strategies: the orderings, ``hierarchical`` (``dynamic`` with every piece
#: reduced by the two-level algorithm, to attribute the algorithm's gain alone) and ``slack``
#: (``dynamic`` ranked by the seed's slack rule, ``priority="slack"``)
COMMSCHED_KINDS = (*COMMSCHED_ORDERINGS, "hierarchical", "slack")


@dataclass(frozen=True)
class StrategySpec:
    """A parsed ``--strategies`` entry."""

    name: str  # as the user wrote it, e.g. "ddp:4"
    kind: str  # ddp | horovod | fifo | dynamic | static | planned | auto | hierarchical | slack | allreduce
    bucket_mb: float | None = None

    @property
    def is_commsched(self) -> bool:
        """Whether commsched schedules this strategy's communication."""
        return self.kind in COMMSCHED_KINDS


def parse_strategies(text: str) -> list[StrategySpec]:
    """Parse ``"ddp,ddp:4,horovod,fifo,dynamic,static,auto,planned,hierarchical,slack"``; ``ValueError`` on a bad
    entry."""
    specs = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        kind, _, arg = name.partition(":")
        if kind == "ddp":
            mb = None
            if arg:
                try:
                    mb = float(arg)
                except ValueError:
                    mb = -1.0
                if not mb > 0:
                    raise ValueError(f"strategy {name!r}: bucket size must be a positive "
                                     "number of MB, e.g. ddp:4")
            specs.append(StrategySpec(name, "ddp", mb))
        elif kind in ("horovod", "allreduce", *COMMSCHED_KINDS) and not arg:
            specs.append(StrategySpec(name, kind))
        else:
            raise ValueError(
                f"unknown strategy {name!r}; use ddp, ddp:<bucket MB>, horovod, fifo, "
                "dynamic, static, auto, planned, hierarchical, slack or allreduce"
            )
    if not specs:
        raise ValueError("no strategy given; e.g. --strategies ddp,ddp:4,dynamic")
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"strategy listed twice in {text!r}")
    return specs
