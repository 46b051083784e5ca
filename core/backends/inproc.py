"""An in-process collective engine: threads as ranks, for the core's own tests.

It behaves like gloo or NCCL where it matters to the scheduler: the k-th
operation a rank starts is matched with the k-th operation of every other rank
(so ranks that start pieces in different orders are caught, as
:attr:`InProcessWorld.mismatches`), one link carries one collective at a time at
a modelled speed, and faults can be injected: a piece that fails, a rank that dies.
Tensors are ``array.array`` objects; views are ``memoryview`` slices (no copies).
"""

from __future__ import annotations

import array
import collections
import threading
import time
from typing import Any, Callable, Iterable, Optional

from commsched.errors import OrderAgreementError
from commsched.store import InMemoryStore

__all__ = ["ArrayOps", "InProcessBackend", "InProcessWorld"]


class ArrayOps:
    """:class:`~commsched.partition.TensorOps` for ``array.array`` tensors."""

    def numel(self, tensor: array.array) -> int:
        return len(tensor)

    def element_size(self, tensor: array.array) -> int:
        return tensor.itemsize

    def flat_view(self, tensor: array.array, start: int, stop: int) -> memoryview:
        return memoryview(tensor)[start:stop]


class InProcessWorld:
    """``world_size`` ranks living in one process, sharing an :class:`InMemoryStore`.

    Args:
        bandwidth_bytes_per_s: link speed of the cost model; an all-reduce of S bytes
            takes ``latency_s + 2(N-1)/N * S / bandwidth`` (ring all-reduce). None: instant.
        fail_pieces: piece names (``"tensor#index"``) whose collective fails on every rank.
        kill_rank, kill_after: rank ``kill_rank`` dies after starting ``kill_after``
            pieces; collectives that need it then fail on the others, as a closed
            connection does in gloo.
    """

    def __init__(self, world_size: int, *, bandwidth_bytes_per_s: float | None = None, latency_s: float = 0.0,
                 fail_pieces: Iterable[str] = (), kill_rank: int | None = None, kill_after: int = 0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        self.world_size = world_size
        self.store = InMemoryStore()
        self.bandwidth = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self.fail_pieces = set(fail_pieces)
        self.kill_rank = kill_rank
        self.kill_after = kill_after
        self.issued: list[list[str]] = [[] for _ in range(world_size)]
        self.mismatches: list[str] = []
        self.in_flight_bytes = [0] * world_size
        self.max_in_flight_bytes = [0] * world_size
        self.dead: set[int] = set()
        self._slots: dict[int, dict[int, tuple[Any, Callable]]] = collections.defaultdict(dict)
        self._ready: collections.deque[int] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._link = threading.Thread(target=self._link_loop, name="inproc-link", daemon=False)
        self._link.start()

    def backend(self, rank: int) -> "InProcessBackend":
        """The backend object for one rank."""
        return InProcessBackend(self, rank)

    def close(self) -> None:
        """Stop the link thread (collectives still queued fail)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._link.join()

    def __enter__(self) -> "InProcessWorld":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- engine
    def _start(self, rank: int, piece: Any, done: Callable[[Optional[BaseException]], None]) -> None:
        with self._cv:
            if rank in self.dead:
                raise ConnectionError(f"rank {rank} was killed by fault injection")
            seq = len(self.issued[rank])
            if self.kill_rank == rank and seq >= self.kill_after:
                self.dead.add(rank)
                self._fail_waiting_on_dead()
                raise ConnectionError(f"rank {rank} was killed by fault injection")
            self.issued[rank].append(piece.name)
            self.in_flight_bytes[rank] += piece.nbytes
            self.max_in_flight_bytes[rank] = max(self.max_in_flight_bytes[rank], self.in_flight_bytes[rank])
            slots = self._slots[seq]
            slots[rank] = (piece, done)
            self._maybe_ready(seq)

    def _maybe_ready(self, seq: int) -> None:
        slots = self._slots[seq]
        live = [r for r in range(self.world_size) if r not in self.dead]
        if all(r in slots for r in live) and len(slots) == len(live) + len(self.dead & set(slots)):
            self._ready.append(seq)
            self._cv.notify_all()

    def _fail_waiting_on_dead(self) -> None:
        queued = set(self._ready)  # complete already: queueing them again would run them twice
        for seq in list(self._slots):
            if seq not in queued:
                self._maybe_ready(seq)

    def _link_loop(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._closing:
                    self._cv.wait()
                if not self._ready:
                    stranded = [cb for slots in self._slots.values() for _, cb in slots.values()]
                    self._slots.clear()
                    break
                seq = self._ready.popleft()
                slots = self._slots.pop(seq)
                dead = sorted(self.dead)
            self._run(seq, slots, dead)
        for done in stranded:
            done(ConnectionError("the in-process world was closed"))

    def _run(self, seq: int, slots: dict[int, tuple[Any, Callable]], dead: list[int]) -> None:
        pieces = {r: p for r, (p, _) in slots.items()}
        names = {r: p.name for r, p in pieces.items()}
        error: Optional[BaseException] = None
        if len(set(names.values())) > 1 or len({p.nbytes for p in pieces.values()}) > 1:
            message = f"operation {seq} was started with different pieces on different ranks: {names}"
            self.mismatches.append(message)
            error = OrderAgreementError(message)
        elif dead:
            error = ConnectionError(f"rank {dead[0]} closed the connection (it died) during operation {seq}")
        elif any(n in self.fail_pieces for n in names.values()):
            error = RuntimeError(f"injected failure of piece {next(iter(names.values()))}")
        else:
            nbytes = next(iter(pieces.values())).nbytes
            if self.bandwidth:
                n = self.world_size
                time.sleep(self.latency_s + 2 * (n - 1) / n * nbytes / self.bandwidth)
            elif self.latency_s:
                time.sleep(self.latency_s)
            views = [p.view for p in pieces.values()]
            if len(views) > 1:
                for i in range(len(views[0])):
                    total = sum(v[i] for v in views)
                    for v in views:
                        v[i] = total
        with self._cv:
            for r, p in pieces.items():
                self.in_flight_bytes[r] -= p.nbytes
        for _, (_, done) in sorted(slots.items()):
            done(error)


class InProcessBackend:
    """One rank's view of an :class:`InProcessWorld`; a :class:`~commsched.scheduler.Backend`."""

    negotiates_order = False
    #: the link thread calls ``done`` outside the world's lock: a completion may start the next piece there
    starts_in_done = True

    def __init__(self, world: InProcessWorld, rank: int) -> None:
        if not 0 <= rank < world.world_size:
            raise ValueError(f"rank={rank} must be in [0, {world.world_size})")
        self.world = world
        self.rank = rank
        self.world_size = world.world_size

    closed = False  # set by close(): what tests look at to see the scheduler released its engine

    def start(self, piece: Any, done: Callable[[Optional[BaseException]], None]) -> None:
        self.world._start(self.rank, piece, done)

    def close(self) -> None:
        """Nothing to release (the world is the test's); recorded in ``closed``."""
        self.closed = True
