"""Before the first step of ``ordering="planned"``: every rank checks the plan and that all ranks hold the same one.

:func:`check_plan` loads the plan and refuses one made for another model or another
number of ranks; :func:`agree_on_plan` then has every rank post what it found to the
rendezvous store (:func:`store_gather`; its plan's digest and a summary, or why it
cannot run the plan) and read every other rank's. A rank whose plan is wrong, or differs from rank 0's,
makes *every* rank raise :class:`~commsched.plan.PlanMismatch` naming the rank and
the difference, before any collective is issued: no rank is left waiting in a
collective the others never start. A rank that posts nothing within ``timeout_s``
(dead, or not running ``planned``) is a :class:`~commsched.errors.CommschedTimeout`.

Framework-free: the plugins pass the parameters as :class:`~commsched.plan.PlannedTensor`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterable

from commsched.errors import CommschedTimeout
from commsched.plan import Plan, PlanMismatch, PlannedTensor
from commsched.store import Store

__all__ = ["agree_on_plan", "check_plan", "note_engine", "plan_summary", "store_gather"]

log = logging.getLogger(__name__)

_SUMMARY_FIELDS = ("digest", "fingerprint", "world", "credit_bytes", "groups", "pieces", "source")


def note_engine(plan: Plan, why: str) -> None:
    """Say (a warning) that ``plan`` names the framework's reducer but its pieces run instead, and ``why``."""
    if plan.engine == "reducer":
        log.warning("plan %s names the framework's own reducer (DDP's engine, buckets of %s B), which cannot run "
                    "here (%s): its pieces, DDP's shape, run on commsched instead", plan.digest[:12],
                    plan.bucket_bytes, why)


def check_plan(source: Any, parameters: Iterable[PlannedTensor], world_size: int) -> Plan:
    """The plan ``source`` (a :class:`Plan` or the path of its JSON), checked against this run:
    ``PlanMismatch`` for another model (naming the parameters) or another world size; the
    JSON's own errors (``ValueError``, ``OSError``) as they are."""
    if source is None:
        raise ValueError("ordering='planned' was given no plan; pass SchedulerConfig(ordering='planned', "
                         "plan='plan.json') (make one with `commsched plan`)")
    plan = source if isinstance(source, Plan) else Plan.from_json(str(source))
    plan.check_world(world_size)
    plan.check_model(parameters)
    return plan


def plan_summary(plan: Plan, source: Any = None) -> dict[str, Any]:
    """What ranks compare: the digest, and the parts of the plan a mismatch message names."""
    return {"digest": plan.digest, "fingerprint": plan.fingerprint[:12],
            "world": f"{plan.nodes}x{plan.ranks_per_node}", "credit_bytes": plan.credit_bytes,
            "groups": len(plan.groups), "pieces": len(plan.pieces),
            "source": source if isinstance(source, str) else None}


def store_gather(store: Store, prefix: str, rank: int, world_size: int,
                 timeout_s: float) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """A ``gather`` for :func:`agree_on_plan` over the rendezvous store: each rank sets
    ``<prefix>/plan/<rank>`` and reads every other rank's, waiting at most ``timeout_s`` in
    all (:class:`~commsched.errors.CommschedTimeout` names the rank that posted nothing).

    Rank 0 hosts the store (torch's TCPStore master, MXNet's worker 0), and after the gather
    every rank may raise (a plan mismatch) and exit, which takes the store down with rank
    0's process. So each rank marks ``<prefix>/plan/read/<rank>`` once it has read every post,
    and rank 0 returns only when every rank has marked (within the same ``timeout_s``), then
    deletes the posts and the marks: nothing is cut off mid-read and no key is left."""
    def key(what: str, r: int) -> str:
        return f"{prefix}/plan/{what}{r}"

    def gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
        store.set(key("", rank), json.dumps(mine).encode())
        deadline = time.monotonic() + timeout_s
        posted = []
        for other in range(world_size):
            try:
                raw = store.get(key("", other), max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                forget([key("", rank)])  # this rank stops here: its post would never be deleted
                raise CommschedTimeout(f"rank {rank} waiting for rank {other} to check its plan (does every rank "
                                       "run ordering='planned' with a plan, and is it alive?)", timeout_s) from None
            posted.append(json.loads(raw.decode()))
        if rank != 0:
            try:
                store.set(key("read/", rank), b"1")
            except Exception:  # noqa: BLE001 - rank 0 may take the store down once it has this mark, before
                # the reply arrives; this rank has every post, so the outcome is decided already
                log.debug("the store closed after rank %d's read mark", rank, exc_info=True)
            return posted
        for other in range(1, world_size):
            try:
                store.get(key("read/", other), max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                forget(every)
                raise CommschedTimeout(f"rank 0 waiting for rank {other} to read every rank's plan check (is it "
                                       "alive?)", timeout_s) from None
        forget(every)
        return posted

    every = [key("", r) for r in range(world_size)] + [key("read/", r) for r in range(1, world_size)]

    def forget(keys: list[str]) -> None:
        for k in keys:
            try:
                store.delete(k)
            except Exception as exc:  # noqa: BLE001 - cleanup on the way out: the store may be gone
                log.debug("could not delete %r: %r", k, exc)
    return gather


def agree_on_plan(found: Plan | BaseException, *, rank: int, world_size: int,
                  gather: Callable[[dict[str, Any]], list[dict[str, Any]]] | None, source: Any = None) -> Plan:
    """Every rank calls this once, with its checked plan or the error :func:`check_plan` raised.

    ``gather(what_this_rank_found) -> [what each rank found]`` exchanges a small JSON-able
    dict between all ranks (:func:`store_gather`, or an engine's all-gather of objects);
    None with one rank. Returns the plan when every rank holds one with rank 0's digest.
    Otherwise raises, on every rank: this rank's own error as a :class:`PlanMismatch` (the
    same object if it was one); else ``PlanMismatch`` naming each other rank that cannot
    run its plan and why, or whose plan differs from rank 0's and in what.
    """
    posted: list[dict[str, Any]] = []
    if world_size > 1:
        if gather is None:
            raise ValueError("agree_on_plan needs gather= (the rendezvous store) with more than one rank")
        mine = ({"error": f"{type(found).__name__}: {found}"} if isinstance(found, BaseException)
                else plan_summary(found, source))
        posted = gather(mine)
    if isinstance(found, BaseException):
        if isinstance(found, PlanMismatch):
            raise found
        raise PlanMismatch(f"rank {rank} cannot run its plan: {found}") from found
    problems = [f"rank {r} cannot run its plan ({info['error']})" for r, info in enumerate(posted) if "error" in info]
    if problems:
        raise PlanMismatch("; ".join(problems) + f" (rank {rank}'s own plan is fine); every rank stops before the "
                           "first step")
    differ = []
    lead = posted[0] if posted else None
    for r, info in enumerate(posted):
        if info["digest"] != lead["digest"]:
            fields = [f"{k} {info.get(k)!r} vs rank 0's {lead.get(k)!r}" for k in _SUMMARY_FIELDS
                      if info.get(k) != lead.get(k) and k != "digest"]
            differ.append(f"rank {r}'s plan (digest {info['digest'][:12]}) differs from rank 0's (digest "
                          f"{lead['digest'][:12]})" + (f": {', '.join(fields)}" if fields else
                                                       ": same sizes, another piece order, algorithm or grouping"))
    if differ:
        raise PlanMismatch("; ".join(differ) + ". Every rank must load the same plan file (copy rank 0's plan.json "
                           "to every node)")
    return found
