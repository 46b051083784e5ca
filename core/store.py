"""The small key-value store used to agree on order across ranks.

Plugins adapt their framework's rendezvous store (torch's c10d ``Store``, for
instance) to :class:`Store`. :class:`InMemoryStore` serves threads-as-ranks tests.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Protocol

__all__ = ["InMemoryStore", "Store"]


class Store(Protocol):
    """A key-value store shared by all ranks, with FIFO queues.

    ``get`` blocks until the key exists or ``timeout_s`` passes, then raises
    ``TimeoutError``; ``pop`` likewise waits for a value pushed on a queue. Neither
    may hold Python's GIL while it waits, and a ``pop`` blocked on one thread must
    not block other threads' calls (use a separate connection for it). ``check``
    never blocks. ``delete`` removes a key and a queue of that name. ``add`` adds to
    an integer counter (created at 0) atomically and returns the new value: it is
    optional (callers check for it), and what lets the last rank to finish with some
    keys delete them.
    """

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout_s: float) -> bytes: ...

    def check(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def push(self, queue: str, value: bytes) -> None: ...

    def pop(self, queue: str, timeout_s: float) -> bytes: ...


class InMemoryStore:
    """A :class:`Store` for ranks that are threads of one process."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = collections.defaultdict(collections.deque)
        self._cv = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._data[key] = bytes(value)
            self._cv.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while key not in self._data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"key {key!r} not set within {timeout_s:g} s")
                self._cv.wait(left)
            return self._data[key]

    def check(self, key: str) -> bool:
        with self._cv:
            return key in self._data

    def delete(self, key: str) -> None:
        with self._cv:
            self._data.pop(key, None)
            self._queues.pop(key, None)

    def add(self, key: str, amount: int) -> int:
        with self._cv:
            value = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(value).encode()
            self._cv.notify_all()
            return value

    def push(self, queue: str, value: bytes) -> None:
        with self._cv:
            self._queues[queue].append(bytes(value))
            self._cv.notify_all()

    def pop(self, queue: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._queues[queue]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"queue {queue!r} stayed empty for {timeout_s:g} s")
                self._cv.wait(left)
            return self._queues[queue].popleft()

    def __len__(self) -> int:
        """Keys plus values waiting in queues (to check that nothing accumulates)."""
        with self._cv:
            return len(self._data) + sum(len(q) for q in self._queues.values())
