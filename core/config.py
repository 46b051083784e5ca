"""Scheduler configuration: one validated, immutable object.

Precedence for every field: explicit argument > ``COMMSCHED_<FIELD>`` environment
variable > default. :func:`read_environment` is the only place in commsched that
reads the environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

__all__ = ["ENV_PREFIX", "ORDERINGS", "SchedulerConfig", "check_config", "check_layer_priority", "parse_fusion",
           "parse_nice", "parse_size", "read_environment", "read_terminal_environment"]

ENV_PREFIX = "COMMSCHED_"
ORDERINGS = ("dynamic", "static", "fifo", "planned", "auto")

_UNSET: Any = type("_Unset", (), {"__repr__": lambda self: "<unset>"})()

_DEFAULTS: dict[str, Any] = {
    "partition_bytes": 4 << 20,
    "credit_bytes": 16 << 20,
    "fusion_bytes": 256 << 10,
    "ordering": "dynamic",
    "cross_iteration": True,
    "timeout_s": 300.0,
    "timeline": None,
    "plan": None,
    "priority": "layer",
    "slack_alpha": 1.0,
    "decide_ahead": True,
    "ready_reports": True,
    "thread_nice": 0,
    "verify_order": True,
    "direct_start": False,
}

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def read_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the ``COMMSCHED_<FIELD>`` overrides present in ``environ`` (default ``os.environ``).

    Keys are field names of :class:`SchedulerConfig`; values are the raw strings.
    """
    env = os.environ if environ is None else environ
    found = {}
    for f in fields(SchedulerConfig):
        key = ENV_PREFIX + f.name.upper()
        if key in env:
            found[f.name] = env[key]
    return found


def read_terminal_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``CI`` and ``TERM`` from ``environ`` (default ``os.environ``), for the progress display
    (:func:`commsched.progress.wanted`): not settings, but read here with the rest."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in ("CI", "TERM") if k in env}


def parse_size(value: Any, field: str = "size") -> int:
    """Parse a byte count: an int, or a string such as ``"4194304"``, ``"4MiB"``, ``"1mb"``.

    Raises ``ValueError`` naming ``field`` for anything that is not a positive whole
    number of bytes.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not a byte count; "
                         "give a positive integer such as 4194304 or '4MiB'")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{field}={value!r} is not a byte count; give a positive integer such as 4194304, "
                f"or a number with a unit in {sorted(u for u in _SIZE_UNITS if u)} such as '4MiB'"
            )
        number = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ValueError(f"{field}={value!r} is not a byte count; "
                         "give a positive integer such as 4194304 or '4MiB'")
    if number <= 0:
        raise ValueError(f"{field}={value!r} must be a positive number of bytes (at least 1)")
    return number


def parse_fusion(value: Any, field: str = "fusion_bytes") -> int:
    """A fusion threshold: a byte count as :func:`parse_size` reads it, or ``0``/``"0"``/``"off"`` (no fusion)."""
    if isinstance(value, str) and value.strip().lower() in ("0", "off", "none", "0b"):
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    try:
        return parse_size(value, field)
    except ValueError:
        raise ValueError(f"{field}={value!r} is not a fusion threshold; give a byte count such as 65536 or "
                         "'64KiB', or 0 (or 'off') to reduce every tensor on its own") from None


def _parse_ordering(value: Any, field: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in ORDERINGS:
        raise ValueError(f"{field}={value!r} is not a known ordering; use one of {', '.join(ORDERINGS)}")
    return value.strip().lower()


def _parse_bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{field}={value!r} is not a boolean; use True/False "
                     "(or 1/0, true/false, yes/no, on/off in the environment)")


def _parse_timeout(value: Any, field: str) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not number > 0 or number == float("inf"):
        raise ValueError(f"{field}={value!r} must be a finite number of seconds greater than 0, such as 300")
    return number


def _parse_timeline(value: Any, field: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"{field}={value!r} must be a file path (str or os.PathLike) or None to disable the timeline")
    return value or None


def _parse_plan(value: Any, field: str) -> Any:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return value or None
    from commsched.plan import Plan

    if isinstance(value, Plan):
        return value
    raise ValueError(f"{field}={value!r} must be the path of a plan JSON (from `commsched plan`), a "
                     "commsched.plan.Plan, or None")


def _parse_priority(value: Any, field: str) -> str:
    priorities = ("layer", "slack")  # commsched.costmodel.slack.PRIORITIES (not imported: config stays light)
    if not isinstance(value, str) or value.strip().lower() not in priorities:
        raise ValueError(f"{field}={value!r} is not a known priority rule; use one of {', '.join(priorities)}")
    return value.strip().lower()


def _parse_alpha(value: Any, field: str) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not (number >= 0) or number == float("inf"):
        raise ValueError(f"{field}={value!r} must be a finite number >= 0, such as 1.0 (0 is plain layer order)")
    return number


def parse_nice(value: Any, field: str = "thread_nice") -> int:
    """A nice increment: a whole number from 0 to 19 (an int or its text); ``ValueError`` naming ``field``."""
    text = value.strip() if isinstance(value, str) else value
    try:
        number = int(text) if isinstance(text, (int, str)) and not isinstance(text, bool) else None
    except ValueError:
        number = None
    if number is None or not 0 <= number <= 19:
        raise ValueError(f"{field}={value!r} must be a whole number from 0 to 19 (how much lower than the "
                         "training thread commsched's own threads run; 0 the same)")
    return number


_PARSERS = {
    "partition_bytes": parse_size,
    "credit_bytes": parse_size,
    "fusion_bytes": parse_fusion,
    "ordering": _parse_ordering,
    "cross_iteration": _parse_bool,
    "timeout_s": _parse_timeout,
    "timeline": _parse_timeline,
    "plan": _parse_plan,
    "priority": _parse_priority,
    "slack_alpha": _parse_alpha,
    "decide_ahead": _parse_bool,
    "ready_reports": _parse_bool,
    "thread_nice": parse_nice,
    "verify_order": _parse_bool,
    "direct_start": _parse_bool,
}


@dataclass(frozen=True)
class SchedulerConfig:
    """How commsched partitions, orders and paces communication.

    Attributes:
        partition_bytes: largest piece, in bytes (rounded down to whole elements; a
            piece holds at least one element). Default 4 MiB.
        credit_bytes: most bytes in flight at once. A single piece larger than the
            credit may go alone when nothing else is in flight. Default 16 MiB.
        ordering: ``"dynamic"`` (rank 0 decides each next piece and publishes it),
            ``"static"`` (the order observed in the first step, then fixed on every
            rank), ``"fifo"`` (local ready order; only for engines that agree on
            order themselves, and as a baseline), or ``"planned"`` (the order, piece
            sizes, fusion groups and algorithms of ``plan``, fixed before training on
            every rank), or ``"auto"`` (PyTorch: an online tuner chooses the ordering,
            piece size, credit and fusion threshold from measured step times, changing
            them only at step boundaries every rank agreed on; docs/tuning.md).
            Default ``"dynamic"`` (``"auto"`` becomes the default only once the issue's
            benchmark targets are measured to hold).
        cross_iteration: let the next forward start layer by layer while later
            layers are still communicating. Default True.
        timeout_s: longest any wait may block before raising ``CommschedTimeout``.
            Default 300.
        timeline: path of a Chrome-trace JSON file to write, or None. Default None.
        plan: with ``ordering="planned"``, the plan to execute: the path of a JSON
            written by ``commsched plan`` (or a :class:`commsched.plan.Plan`). With a
            plan, ``partition_bytes`` and ``credit_bytes`` come from the plan. None
            (the default) with ``"planned"``: the PyTorch optimizer runs the first steps
            as ``"dynamic"``, rank 0 plans from their profile and every rank switches to the
            plan at an agreed step (docs/tuning.md). A plan whose ``engine`` is ``"reducer"``
            runs on torch's own reducer (DDP's) from step 2 where it can (docs/planner.md).
        decide_ahead: with ``ordering="dynamic"`` (and ``static``'s recorded step), rank 0
            publishes the whole remaining order of a step in one message as soon as that
            order is final (the step ended and every one of its gradients is queued), ahead
            of the credit that lets each piece start; the other ranks then start each piece
            as soon as their own credit frees, without waiting for a message per piece.
            The order is exactly the one decided piece by piece. Default True; False
            publishes each piece when rank 0 starts it (docs/ARCHITECTURE.md).
        ready_reports: with ``ordering="dynamic"`` on more than one rank, the other ranks report
            each gradient to rank 0 as it becomes ready there (one store message per batch), and
            rank 0 starts a piece once it is ready on every rank: a collective moves only when
            its last rank issues it, so a piece rank 0 starts while another rank still computes
            that gradient holds the credit while the link idles. When nothing is in flight
            rank 0 starts its most urgent piece anyway. Default True; False decides on rank 0's
            readiness alone (docs/tuning.md, "Pieces ready on every rank").
        thread_nice: how much lower than the process's own (the training thread's) CPU priority
            commsched's background threads run, as a nice increment from 0 to 19 (Linux, where
            nice is per thread; ignored elsewhere). Where compute and these threads share busy
            cores, the training thread then gets the core first. Default 0 (docs/tuning.md,
            "commsched's threads below the training thread").
        verify_order: with ``ordering="fifo"`` on an engine that pairs collectives by position
            (torch.distributed's gloo), every rank checks after each step that all ranks reduced the
            same tensors in the same order (one 24-byte all-reduce behind the step's pieces) and
            raises ``OrderAgreementError`` naming the first difference otherwise; without it,
            same-sized pieces of different tensors would be summed together silently. The other
            orderings agree on the order anyway. Default True (:mod:`commsched.order_check`).
        direct_start: the thread whose event lets pieces start starts them itself, instead of waking
            the dispatch thread to do it (one thread hop less): a piece's completion, on an engine
            whose completion callback may start collectives (torch.distributed's gloo path, the
            in-process test engine: ``Backend.starts_in_done``), starts what its credit freed on the
            engine's thread; the ``order`` thread starts what a delivered decision (a follower) or
            ready report (rank 0 of ``dynamic``) allows. Never waits for the issue lock: when another
            thread is issuing, the dispatch thread decides as before. Default False: it cuts the
            scheduler's own CPU per piece by 15-32 %, but measured ``dynamic`` 2-9 % slower a step
            on the contended 2-core bench (balanced, gpt2) while about 2 % faster on comm-heavy
            (docs/tuning.md, "Starting the next piece where its credit frees"). Under
            ``ordering="auto"`` this is the start point: where the engine allows it, the tuner
            measures both values and keeps the faster.

    Every field left out is taken from ``COMMSCHED_<FIELD>`` if set, else the
    default. Invalid values raise ``ValueError`` naming the field, the value and
    what is allowed, here at construction.
    """

    partition_bytes: int = _UNSET
    credit_bytes: int = _UNSET
    fusion_bytes: int = _UNSET
    ordering: str = _UNSET
    cross_iteration: bool = _UNSET
    timeout_s: float = _UNSET
    timeline: str | None = _UNSET
    plan: Any = _UNSET
    priority: str = _UNSET
    slack_alpha: float = _UNSET
    decide_ahead: bool = _UNSET
    ready_reports: bool = _UNSET
    thread_nice: int = _UNSET
    verify_order: bool = _UNSET
    direct_start: bool = _UNSET

    def __post_init__(self) -> None:
        env = None
        for f in fields(self):
            value = getattr(self, f.name)
            source = f.name
            if value is _UNSET:
                if env is None:
                    env = read_environment()
                if f.name in env:
                    value = env[f.name]
                    source = ENV_PREFIX + f.name.upper()
                else:
                    value = _DEFAULTS[f.name]
            object.__setattr__(self, f.name, _PARSERS[f.name](value, source))
        if self.plan is not None and self.ordering != "planned":
            raise ValueError(f"plan={self.plan!r} is only read with ordering='planned' (ordering is "
                             f"{self.ordering!r}); pass SchedulerConfig(ordering='planned', plan=...)")
        if self.priority == "slack" and self.ordering != "dynamic":
            raise ValueError(f"priority='slack' ranks the pieces rank 0 decides under ordering='dynamic' (ordering "
                             f"is {self.ordering!r}); use ordering='dynamic', or priority='layer'")


def check_config(config: Any) -> None:
    """What every plugin's constructor does with its ``config`` argument before anything starts:
    ``None`` or a :class:`SchedulerConfig`, else a ``TypeError`` saying how to build one (from a
    dict: ``SchedulerConfig(**that_dict)``)."""
    if config is not None and not isinstance(config, SchedulerConfig):
        hint = f"commsched.SchedulerConfig(**{config!r})" if isinstance(config, dict) else \
            "commsched.SchedulerConfig(partition_bytes=..., credit_bytes=...)"
        raise TypeError(f"config must be a commsched.SchedulerConfig, got {type(config).__name__}; use config={hint}")


def check_layer_priority(config: SchedulerConfig, plugin: str) -> None:
    """What a plugin without the slack rule does with ``config``: ``priority="slack"`` is computed by the
    PyTorch ``DistributedOptimizer`` from the profile of its first steps; ``plugin`` orders by layer."""
    if config.priority != "layer":
        raise ValueError(f"priority={config.priority!r} is computed by the PyTorch DistributedOptimizer from the "
                         f"profile of its first steps; {plugin} ranks pieces by layer order: use priority='layer' "
                         "(or unset COMMSCHED_PRIORITY)")
