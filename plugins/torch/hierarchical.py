"""The two-level all-reduce on torch.distributed: intra-node reduce-scatter, inter-node all-reduce, all-gather.

On ``nodes`` × ``ranks_per_node`` ranks, numbered node-major (rank ``k`` is local rank
``k % r`` of node ``k // r``), a flat ring pushes ``2(n−1)/n`` of every piece through each
node's NIC from every rank of the node; the two-level algorithm crosses the NIC with one
``1/r`` shard per rank only:

1. **reduce-scatter** inside the node (``r`` ranks): local rank ``l`` ends with shard ``l``
   of the node's sum (a piece whose element count is not a multiple of ``r`` is padded
   with zeros to ``r · ceil(n / r)``);
2. **all-reduce** of that shard among the ``nodes`` ranks with the same local rank: the
   shard of the world's sum;
3. **all-gather** inside the node: every rank has the whole sum (the padding is dropped).

gloo on CPU has ``reduce_scatter`` (``reduce_scatter_single``/``reduce_scatter_tensor``) and
``all_gather_into_tensor`` in this torch, so no fallback is needed; where the single-tensor
calls are missing the list forms are used (same collective). Sums are in a different order
than the ring's, so results equal a flat all-reduce up to rounding (allclose, not bitwise).

Order: gloo and NCCL match a group's collectives by issue order, so the three phases run as
a pipeline of three named threads (``commsched-hier-{rs,ar,ag}-r<rank>``), each with a process
group of its own (created once, at construction, by every rank in the same order). A phase
issues the pieces it is handed in the order they come, keeps up to ``depth`` of them in
flight at once (default 2, the gloo group's worker threads), and hands them to the next phase
in that same order as they complete; pieces enter in the scheduler's agreed issue order, so
every group sees the same sequence on every rank. With one piece in flight per phase the
slow inter-node link idled, for every piece, while a thread woke up to issue the next one
(measured on 2 × 2 ranks of 4 workers on 2 cores: about 3 ms a piece); with two, the engine
has the next piece before the link frees. A piece in flight longer than ``timeout_s`` fails
with a :class:`~commsched.errors.CommschedError` naming it and its phase. ``close()`` stops
the threads (after the pieces still queued) and destroys the groups.
"""

from __future__ import annotations

import collections
import datetime
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from commsched.costmodel.profile import union_s
from commsched.errors import CommschedError

__all__ = ["HierarchicalAllReduce"]

log = logging.getLogger(__name__)

_STOP = object()

#: the three phases, in pipeline order (the keys of :meth:`HierarchicalAllReduce.phase_stats`)
PHASES = ("reduce_scatter", "all_reduce", "all_gather")
#: pieces per phase whose times are kept (a ring: the most recent ones)
SPANS_KEPT = 4096


def _reduce_scatter(out: torch.Tensor, src: torch.Tensor, group: Any) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
    if fn is not None:
        return fn(out, src, group=group, async_op=True)
    return dist.reduce_scatter(out, list(src.chunk(dist.get_world_size(group))), group=group, async_op=True)


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group: Any) -> Any:
    fn = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    if fn is not None:
        return fn(out, shard, group=group, async_op=True)
    return dist.all_gather(list(out.chunk(dist.get_world_size(group))), shard, group=group, async_op=True)


class _Job:
    __slots__ = ("view", "done", "name", "step", "shard", "padded", "handed_at")

    def __init__(self, view: torch.Tensor, done: Callable[[Optional[BaseException]], None], name: str,
                 step: Optional[int]) -> None:
        self.view, self.done, self.name, self.step = view, done, name, step
        self.shard: Optional[torch.Tensor] = None
        self.padded: Optional[torch.Tensor] = None
        self.handed_at = time.time()  # when the current phase was handed the piece


class _Flight:
    """One piece in flight in one phase: its collective, and its outcome once known."""

    __slots__ = ("job", "deadline", "work", "finished", "error", "issued_at", "landed_at")

    def __init__(self, job: _Job, deadline: float, work: Any, issued_at: float) -> None:
        self.job, self.deadline = job, deadline
        self.work = work  # None once a completion callback will report the outcome
        self.finished = False
        self.error: Optional[BaseException] = None
        self.issued_at = issued_at  # time.time(), the clock of Scheduler.stats()["issue_times"]
        self.landed_at: Optional[float] = None


class HierarchicalAllReduce:
    """The two-level sum all-reduce of flat, contiguous CPU tensors (see the module docstring).

    Every rank of the default group must construct it, with the same ``nodes`` and
    ``ranks_per_node``, at the same point (it creates process groups). ``flat`` is True on
    one node or one rank per node: then there is nothing two-level to do and the caller
    reduces with its plain all-reduce.
    """

    def __init__(self, nodes: int, ranks_per_node: int, *, timeout_s: float = 300.0, depth: int = 2) -> None:
        if not dist.is_initialized():
            raise ValueError("the hierarchical all-reduce needs torch.distributed.init_process_group(...) first")
        world = dist.get_world_size()
        if nodes < 1 or ranks_per_node < 1 or nodes * ranks_per_node != world:
            raise ValueError(f"a hierarchical all-reduce on {nodes} node(s) x {ranks_per_node} rank(s) needs "
                             f"{nodes * ranks_per_node} ranks, but the default group has {world}; plan for this "
                             "run's topology (ranks are node-major: rank k is on node k // ranks_per_node)")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.rank = dist.get_rank()
        self.node, self.local_rank = divmod(self.rank, ranks_per_node)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth={depth!r}: the pieces in flight per phase must be an integer >= 1")
        self.depth = depth
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        #: the most pieces one phase had in flight at once (how far the pipeline overlapped)
        self.max_in_flight = 0
        # per phase, the most recent pieces' (name, step, handed, issued, landed) on this rank (time.time())
        self._spans: list[collections.deque] = [collections.deque(maxlen=SPANS_KEPT) for _ in PHASES]
        self.flat = nodes == 1 or ranks_per_node == 1
        self._groups: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        if self.flat:
            return
        backend = dist.get_backend()
        r = ranks_per_node
        # Every rank creates every group, in this one order (new_group is collective on the default group).
        mine = {}
        for phase in ("rs", "ag"):
            for node in range(nodes):
                group = dist.new_group([node * r + i for i in range(r)], backend=backend, timeout=self.timeout)
                if node == self.node:
                    mine[phase] = group
        for local in range(r):
            group = dist.new_group([node * r + local for node in range(nodes)], backend=backend, timeout=self.timeout)
            if local == self.local_rank:
                mine["ar"] = group
        self._rs, self._ar, self._ag = mine["rs"], mine["ar"], mine["ag"]
        self._groups = [self._rs, self._ag, self._ar]
        self._queues = [queue.Queue() for _ in range(3)]
        phases = (("rs", "intra-node reduce-scatter", self._issue_reduce_scatter, None),
                  ("ar", "inter-node all-reduce", self._issue_all_reduce, None),
                  ("ag", "intra-node all-gather", self._issue_all_gather, self._after_all_gather))
        for i, (what, title, issue, after) in enumerate(phases):
            thread = threading.Thread(target=self._loop, args=(i, title, issue, after),
                                      name=f"commsched-hier-{what}-r{self.rank}", daemon=False)
            self._threads.append(thread)
            thread.start()

    def start(self, view: torch.Tensor, done: Callable[[Optional[BaseException]], None], name: str = "",
              step: Optional[int] = None) -> None:
        """Begin the two-level sum of ``view`` (flat, contiguous), in place; ``done(None|exc)`` later,
        from a pipeline thread. Pieces must be started in the same order on every rank. ``step``
        (the training step the piece belongs to) only labels its times (:meth:`phase_stats`)."""
        if self.flat:
            raise CommschedError("HierarchicalAllReduce.start on a flat topology: use the plain all-reduce")
        if self._closed:
            raise CommschedError("the hierarchical all-reduce is closed; create a new DistributedOptimizer")
        if not view.is_contiguous():
            raise ValueError(f"piece {name!r}: the hierarchical all-reduce needs a contiguous flat view")
        self._queues[0].put(_Job(view, done, name, step))

    # ------------------------------------------------------------ phases
    def _issue_reduce_scatter(self, job: _Job) -> Any:
        view, r = job.view, self.ranks_per_node
        n = view.numel()
        size = -(-n // r)
        if size * r != n:  # pad to a multiple of r: every rank's shard has the same size
            job.padded = torch.zeros(size * r, dtype=view.dtype, device=view.device)
            job.padded[:n].copy_(view)
        src = job.padded if job.padded is not None else view
        job.shard = torch.empty(size, dtype=view.dtype, device=view.device)
        return _reduce_scatter(job.shard, src, self._rs)

    def _issue_all_reduce(self, job: _Job) -> Any:
        return dist.all_reduce(job.shard, group=self._ar, async_op=True)

    def _issue_all_gather(self, job: _Job) -> Any:
        out = job.padded if job.padded is not None else job.view
        return _all_gather(out, job.shard, self._ag)

    def _after_all_gather(self, job: _Job) -> None:
        if job.padded is not None:
            job.view.copy_(job.padded[:job.view.numel()])
        job.shard = job.padded = None

    def _loop(self, index: int, title: str, issue: Callable[[_Job], Any],
              after: Optional[Callable[[_Job], None]]) -> None:
        """One phase: issue in arrival order, at most ``depth`` in flight, hand on in that order.

        The inbox carries three kinds of events: a job from the previous phase (or
        :meth:`start`), ``_STOP``, and a finished :class:`_Flight` (put by the engine's
        completion callback). The wait for events is bounded by the oldest piece's
        deadline. A collective without a completion future (gloo's reduce-scatter in this
        torch) is waited for here instead, oldest first, with the pieces behind it already
        issued.
        """
        inbox = self._queues[index]
        outbox = self._queues[index + 1] if index + 1 < len(self._queues) else None
        waiting: collections.deque[_Job] = collections.deque()  # handed to us, not issued yet
        flight: collections.deque[_Flight] = collections.deque()  # issued, in issue order
        limit = self.timeout.total_seconds()
        stopping = False

        def take(event: Any) -> None:
            nonlocal stopping
            if event is _STOP:
                stopping = True
            elif isinstance(event, _Job):
                waiting.append(event)
            # a _Flight: its outcome is on it; it is handed on once it is the oldest

        while True:
            # hand on what finished first: that frees room in flight for the waiting pieces
            while flight and flight[0].finished:
                self._hand_on(index, flight.popleft(), outbox, after, title)
            while waiting and len(flight) < self.depth:
                job = waiting.popleft()
                try:
                    issued_at = time.time()
                    entry = _Flight(job, time.monotonic() + limit, issue(job), issued_at)
                    try:
                        future = entry.work.get_future()
                    except RuntimeError:  # "not implemented": waited for below
                        future = None
                except BaseException as exc:  # the piece fails; the scheduler fails with it
                    job.done(exc)
                    continue
                flight.append(entry)
                self.max_in_flight = max(self.max_in_flight, len(flight))
                if future is not None:
                    entry.work = None
                    future.add_done_callback(lambda fut, entry=entry: self._finished(inbox, entry, fut))
            if stopping and not flight and not waiting:
                if outbox is not None:
                    outbox.put(_STOP)
                return
            if flight and flight[0].work is not None:
                head = flight[0]
                try:
                    head.work.wait(datetime.timedelta(seconds=max(0.0, head.deadline - time.monotonic())))
                except BaseException as exc:
                    head.error = exc
                head.landed_at = time.time()
                head.finished = True
                while True:
                    try:
                        take(inbox.get_nowait())
                    except queue.Empty:
                        break
                continue
            try:
                event = inbox.get(timeout=max(0.0, flight[0].deadline - time.monotonic()) if flight else None)
            except queue.Empty:
                late = flight.popleft()  # its completion, if it ever comes, is ignored
                late.job.done(CommschedError(
                    f"the {title} of piece {late.job.name!r} (hierarchical all-reduce, rank {self.rank}) "
                    f"ran past {limit:g} s: a rank of its group did not take part (it failed, or issued "
                    "pieces in another order)"))
                continue
            take(event)

    @staticmethod
    def _finished(inbox: "queue.Queue", entry: _Flight, fut: Any) -> None:
        """The engine's completion callback (any thread): note the outcome, wake the phase."""
        try:
            fut.value()
        except BaseException as exc:
            entry.error = exc
        entry.landed_at = time.time()
        entry.finished = True
        inbox.put(entry)

    def _hand_on(self, index: int, entry: _Flight, outbox: Optional["queue.Queue"],
                 after: Optional[Callable[[_Job], None]], title: str) -> None:
        job = entry.job
        if entry.error is None and entry.landed_at is not None:
            self._spans[index].append((job.name, job.step, job.handed_at, entry.issued_at, entry.landed_at))
        if entry.error is not None:
            job.done(CommschedError(f"the {title} of piece {job.name!r} (hierarchical all-reduce, rank "
                                    f"{self.rank}) failed: {entry.error}"))
            return
        try:
            if after is not None:
                after(job)
        except BaseException as exc:
            job.done(exc)
            return
        if outbox is not None:
            job.handed_at = time.time()
            outbox.put(job)
        else:
            job.done(None)

    def phase_times(self) -> dict[str, list[tuple[str, Optional[int], float, float, float]]]:
        """Per phase (:data:`PHASES`), the most recent pieces (up to :data:`SPANS_KEPT`) as
        ``(name, step, handed_at, issued_at, landed_at)`` on this rank, ``time.time()`` seconds:
        handed to the phase, issued to the engine, landed (its completion seen)."""
        return {phase: list(spans) for phase, spans in zip(PHASES, self._spans, strict=True)}

    def phase_stats(self, last_steps: int = 3) -> dict[str, Any]:
        """Where a two-level piece's time goes on this rank, per phase (:data:`PHASES`) over the
        pieces kept (:meth:`phase_times`): ``pieces``; ``mean_s``, issue to landing; ``queued_s``,
        the mean wait between being handed to the phase and its issue (the phase's pieces in
        flight, or a core). ``per_step``: for the ``last_steps`` most recent labelled steps, per
        phase ``busy_s`` (the union of its pieces' issue-to-landing spans: how long the phase's link
        had a piece) and ``window_s`` (first issue to last landing); a phase whose ``busy_s`` nears
        the step's window is the pipeline's bottleneck."""
        out: dict[str, Any] = {"depth": self.depth, "max_in_flight": self.max_in_flight, "per_step": {}}
        kept = [list(spans) for spans in self._spans]
        for phase, spans in zip(PHASES, kept, strict=True):
            n = len(spans)
            out[phase] = {"pieces": n,
                          "mean_s": sum(e - i for *_, i, e in spans) / n if n else None,
                          "queued_s": sum(i - h for *_, h, i, _ in spans) / n if n else None}
        labelled = sorted({s[1] for spans in kept for s in spans if s[1] is not None})
        for step in labelled[-last_steps:] if last_steps > 0 else ():
            row: dict[str, Any] = {}
            for phase, spans in zip(PHASES, kept, strict=True):
                mine = sorted((i, e) for _, st, _, i, e in spans if st == step)
                row[phase] = {"pieces": len(mine), "busy_s": union_s(mine),
                              "window_s": (max(e for _, e in mine) - mine[0][0]) if mine else 0.0}
            out["per_step"][str(step)] = row
        return out

    def close(self) -> None:
        """Stop the pipeline (pieces still queued are finished first, each wait bounded by the
        timeout) and destroy the groups. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._threads:
            self._queues[0].put(_STOP)
        limit = self.timeout.total_seconds() * 3 + 1.0
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(limit)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("hierarchical all-reduce threads %s did not stop within %.0f s", alive, limit)
        groups, self._groups = self._groups, []
        if dist.is_initialized():
            for group in groups:
                try:
                    dist.destroy_process_group(group)
                except Exception as exc:  # closing goes on
                    log.debug("destroying a hierarchical group: %r", exc)
