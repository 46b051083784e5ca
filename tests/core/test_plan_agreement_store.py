"""store_gather over a store that rank 0 hosts: no rank is cut off mid-read, no key is left.

Rank 0's process hosts the rendezvous store (torch's TCPStore master, MXNet's worker 0).
After the plan check every rank may raise and exit; if rank 0 left before the others had
read every post, they would get a connection error instead of the plan mismatch.
"""

from __future__ import annotations

import threading
import time

import pytest

from commsched.errors import CommschedTimeout
from commsched.plan_agreement import store_gather
from commsched.store import InMemoryStore


class HostedByRank0(InMemoryStore):
    """A store that goes down the moment rank 0's gather returns (its process exits), and whose
    rank-1 reads are slow (a loaded machine)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.rank1_last_read = 0.0

    def _up(self) -> None:
        if self.down:
            raise ConnectionError("the store's host (rank 0) has exited")

    def set(self, key, value):
        self._up()
        super().set(key, value)

    def get(self, key, timeout_s):
        self._up()
        if threading.current_thread().name == "rank1":
            time.sleep(0.2)
            self._up()
            value = super().get(key, timeout_s)
            self.rank1_last_read = time.monotonic()
            return value
        return super().get(key, timeout_s)

    def delete(self, key):
        self._up()
        super().delete(key)


def run_ranks(store, posts, timeout_s=5.0, world=2, skip=()):
    results, returned = {}, {}

    def run(r):
        try:
            results[r] = store_gather(store, "opt0", r, world, timeout_s)(posts[r])
        except BaseException as exc:
            results[r] = exc
        returned[r] = time.monotonic()
        if r == 0 and isinstance(store, HostedByRank0):
            store.down = True  # rank 0 raises its PlanMismatch and exits: the store goes with it

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world) if r not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return results, returned


def test_rank_0_returns_only_after_every_rank_read_every_post_and_leaves_no_key():
    store = HostedByRank0()
    posts = [{"digest": "aaa"}, {"digest": "bbb"}]
    results, returned = run_ranks(store, posts)
    assert results[0] == posts and results[1] == posts  # rank 1 read both before the store went down
    assert returned[0] >= store.rank1_last_read
    assert len(store) == 0  # posts and read marks deleted by rank 0


def test_three_ranks_leave_no_key():
    store = InMemoryStore()
    posts = [{"digest": str(r)} for r in range(3)]
    results, _ = run_ranks(store, posts, world=3)
    assert all(results[r] == posts for r in range(3))
    assert len(store) == 0


def test_rank_0_waiting_for_a_rank_that_read_but_never_marked_is_a_timeout():
    store = InMemoryStore()
    store.set("opt0/plan/1", b'{"digest": "x"}')  # rank 1 posted, then died before its read mark
    started = time.monotonic()
    with pytest.raises(CommschedTimeout, match="rank 0 waiting for rank 1 to read"):
        store_gather(store, "opt0", 0, 2, 0.3)({"digest": "x"})
    assert time.monotonic() - started < 0.3 + 2.0
    assert len(store) == 0  # rank 0 stopped the agreement: nobody else would delete the posts


def test_a_rank_that_times_out_waiting_for_a_post_deletes_its_own():
    store = InMemoryStore()
    with pytest.raises(CommschedTimeout, match="rank 1 waiting for rank 0 to check its plan"):
        store_gather(store, "opt0", 1, 2, 0.2)({"digest": "x"})
    assert len(store) == 0
