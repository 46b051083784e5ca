"""commsched's adapter over c10d's store: a get is bounded by its own timeout even when the key is
deleted between its wait and its read (c10d would block for the store's timeout, minutes, and every
call of the thread behind it: the CI hang of a Ctrl-C'd peer, where the last rank to close deleted the
abort notice while its completion thread read it), and it does not hold up other threads' calls."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from commsched.plugins.torch.backends import C10dStore  # noqa: E402
from helpers import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def tcp_store():
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=300))


@pytest.fixture
def store():
    yield C10dStore(tcp_store())


class DeletedAfterWait:
    """A c10d store whose ``wait`` returns and then another rank deletes the key: the race."""

    def __init__(self, real, other):
        self._real, self._other = real, other

    def wait(self, keys, timeout):
        self._real.wait(keys, timeout)
        self._other.delete_key(keys[0])

    def clone(self):
        return DeletedAfterWait(self._real.clone(), self._other)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_a_key_deleted_between_wait_and_read_times_out_at_the_calls_timeout_not_the_stores():
    server = tcp_store()
    store = C10dStore(DeletedAfterWait(server, server))
    store.set("k", b"v")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        store.get("k", 0.5)
    assert time.monotonic() - started < 5.0  # the store's own timeout is 300 s


def test_a_blocked_get_does_not_hold_up_another_threads_calls(store):
    blocked = threading.Thread(target=lambda: pytest.raises(TimeoutError, store.get, "never", 3.0), daemon=True)
    blocked.start()
    time.sleep(0.3)  # the other thread is inside its get now
    started = time.monotonic()
    store.set("x", b"1")
    store.delete("x")
    assert store.add("n", 2) == 2
    assert time.monotonic() - started < 1.5
    blocked.join(10)
    assert not blocked.is_alive()
