"""Threads-as-ranks harness for the core's tests.

``run_ranks(world_size, body, config=...)`` builds an :class:`InProcessWorld`, one
:class:`Scheduler` per rank (``observers={rank: fn}`` passes a decision observer),
runs ``body(rank, scheduler)`` on one thread per rank,
closes every scheduler and the world, and returns what each rank returned or
raised. A rank thread that does not finish within ``join_s`` fails the test (a
hang), after the world is closed so that nothing is left running.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from commsched import CommschedError, Scheduler, SchedulerConfig
from commsched.backends import ArrayOps, InProcessWorld


@dataclass
class RankRun:
    """What :func:`run_ranks` observed: per-rank results, errors and errors raised by close()."""

    world: InProcessWorld
    schedulers: list[Scheduler]
    results: list[Any]
    errors: list[BaseException | None]
    close_errors: list[BaseException | None] = field(default_factory=list)

    def raise_first(self) -> None:
        """Re-raise the first error of any rank (so a failing body fails the test with its traceback)."""
        for rank, err in enumerate(self.errors):
            if err is not None:
                raise AssertionError(f"rank {rank} failed: {err!r}") from err


def run_ranks(world_size: int, body: Callable[[int, Scheduler], Any], *, config: SchedulerConfig,
              world: InProcessWorld | None = None, join_s: float = 20.0, close_timeout_s: float = 5.0,
              setup: Callable[[int, Scheduler], None] | None = None, store: Any = None,
              observers: dict[int, Callable] | None = None, **world_kwargs: Any) -> RankRun:
    world = world if world is not None else InProcessWorld(world_size, **world_kwargs)
    store = store if store is not None else world.store
    observers = observers or {}
    schedulers = [Scheduler(world.backend(r), ArrayOps(), config, store=store, observer=observers.get(r))
                  for r in range(world_size)]
    if setup is not None:
        for rank, scheduler in enumerate(schedulers):
            setup(rank, scheduler)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size
    close_errors: list[BaseException | None] = [None] * world_size

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, schedulers[rank])
        except BaseException as exc:  # reported to the test through `errors`
            errors[rank] = exc
        finally:
            try:
                schedulers[rank].close(timeout=close_timeout_s)
            except CommschedError as exc:
                close_errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), name=f"test-rank-{r}") for r in range(world_size)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join(join_s)
        hung = [t.name for t in threads if t.is_alive()]
    finally:
        world.close()  # fails whatever is still queued in the engine, so hung ranks can finish
    if hung:
        for thread in threads:
            thread.join(close_timeout_s + 5)
        pytest.fail(f"rank threads {hung} did not finish within {join_s} s (a hang)")
    return RankRun(world, schedulers, results, errors, close_errors)


@pytest.fixture(scope="session")
def ranks() -> Callable[..., RankRun]:
    """The :func:`run_ranks` harness (session-scoped so hypothesis tests may use it)."""
    return run_ranks
