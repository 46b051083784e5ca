"""Keys commsched writes to a rendezvous store are deleted once no rank needs them.

The order channel's keys (followers' queues, the abort notice) go when the last rank's
scheduler closes; a switch decision goes when the last follower has read it; ``add`` and
a ``delete`` that also drops a queue work the same on the in-memory store and on the TCP
store the MXNet plugin serves.
"""

from __future__ import annotations

import pytest

from commsched.protocol import Channel, Decision as Started
from commsched.store import InMemoryStore
from commsched.tcpstore import StoreClient, StoreServer
from commsched.tuner import AgreedSwitch, Decision


@pytest.fixture(params=["memory", "tcp"])
def store(request):
    if request.param == "memory":
        yield InMemoryStore()
        return
    server = StoreServer()
    client = StoreClient(*server.address)
    client.num_keys = server.num_keys
    try:
        yield client
    finally:
        client.close()
        server.close()


def count(store) -> int:
    return store.num_keys() if hasattr(store, "num_keys") else len(store)


def test_add_counts_atomically_and_delete_drops_a_queue_of_that_name(store):
    assert store.add("c", 1) == 1 and store.add("c", 2) == 3
    store.push("q", b"x")
    store.delete("q")
    store.delete("c")
    assert count(store) == 0
    with pytest.raises(TimeoutError):
        store.pop("q", 0.05)


def test_the_last_rank_to_close_deletes_the_channels_keys(store):
    ranks = [Channel(store, "opt0", r, 3) for r in range(3)]
    ranks[0].publish([Started(0, "a#0")])  # queued for ranks 1 and 2, never read
    ranks[2].publish_abort("rank 2 failed: boom", wake_followers=True)
    ranks[1].close()
    ranks[2].close()
    assert store.check("opt0/abort")  # rank 0 has not closed: it may still need to read why
    ranks[0].close()
    assert count(store) == 0


def test_a_rank_that_never_closes_leaves_only_the_abort_notice_and_the_count(store):
    survivor = Channel(store, "opt0", 0, 2)
    survivor.publish_abort("rank 0 failed: rank 1 is gone", wake_followers=False)
    survivor.close()  # rank 1 died: it never closes
    assert store.check("opt0/abort") and count(store) == 2


def test_a_switch_decision_is_deleted_once_every_follower_read_it(store):
    switches = [AgreedSwitch(r, 3, store=store, prefix="opt0", timeout_s=1.0) for r in range(3)]
    decision = Decision(None, 9, "keep")
    switches[0].publish(4, decision)
    assert switches[0].take(4).reason == "keep"
    assert switches[1].take(4).reason == "keep"
    assert store.check("opt0/switch/4")  # rank 2 has not read it yet
    assert switches[2].take(4).reason == "keep"
    assert count(store) == 0
