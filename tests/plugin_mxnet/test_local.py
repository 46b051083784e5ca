"""Single-process checks of the MXNet plugin: engine gates, the order store, the KVStore
API on a 'local' store (one worker), and the errors users meet."""

from __future__ import annotations

import re
import threading
import time

import pytest

mx = pytest.importorskip("mxnet")
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import commsched  # noqa: E402
from helpers import commsched_threads  # noqa: E402
import commsched.plugins.mxnet as cmx  # noqa: E402
from commsched.plugins.mxnet import gate  # noqa: E402
from commsched.tcpstore import StoreClient, StoreServer  # noqa: E402
from commsched.plugins.mxnet.backends import KVStoreBackend  # noqa: E402
from commsched.plugins.mxnet.tensor_ops import KeyEntry  # noqa: E402

SMALL = commsched.SchedulerConfig(partition_bytes=256, credit_bytes=512, timeout_s=30)


# ------------------------------------------------------------------ gates
@pytest.mark.skipif(not gate.available(), reason="libmxnet without MXEnginePushAsyncND")
def test_a_gate_holds_later_engine_work_until_opened_and_the_avatar_writes_past_it():
    gates = gate.Gates()
    w = mx.nd.ones((64,))
    av = gate.avatar(w)
    g = gates.gate(w, "w")
    doubled = w * 2  # queued behind the gate
    av[:] = 5  # the avatar has its own engine variable: not held
    av.wait_to_read()
    time.sleep(0.05)
    assert gates.closed() == [g]
    g.open()
    assert (doubled.asnumpy() == 10).all()  # it ran after the gate, on the avatar's data
    assert gates.closed() == []
    g.open()  # idempotent


@pytest.mark.skipif(not gate.available(), reason="libmxnet without MXEnginePushAsyncND")
def test_a_notifier_fires_after_queued_writes_and_open_all_releases_everything():
    gates = gate.Gates()
    a = mx.nd.zeros((1000,))
    fired = threading.Event()
    b = a + 1
    gates.notify(b, fired.set)
    assert fired.wait(10)
    held = [gates.gate(mx.nd.zeros((4,))) for _ in range(3)]
    assert len(gates.closed()) == 3
    assert gates.open_all() == 3
    assert all(g.is_open for g in held)
    mx.nd.waitall()  # nothing left waiting in the engine


def test_without_the_engine_calls_the_errors_name_a_gate_that_works(monkeypatch):
    monkeypatch.setattr(gate, "available", lambda: False)
    with pytest.raises(RuntimeError) as info:
        gate.Gates()
    suggested = re.findall(r"gate='(\w+)'", str(info.value))
    assert suggested, str(info.value)
    with pytest.raises(ValueError, match="gate='engine' needs"):
        cmx.KVStore("local", SMALL, gate="engine")
    for mode in suggested:  # what the message tells users to pass is accepted, without the engine calls
        with cmx.KVStore("local", SMALL, gate=mode) as kv:
            assert kv.gate_mode == "issue"


# ------------------------------------------------------------------ store
def test_store_set_get_check_delete_and_timeouts():
    server = StoreServer("127.0.0.1", 0)
    client = StoreClient(*server.address)
    try:
        client.set("a", b"1")
        assert client.get("a", 1.0) == b"1" and client.check("a")
        client.delete("a")
        assert not client.check("a")
        with pytest.raises(TimeoutError):
            client.get("a", 0.1)
        with pytest.raises(TimeoutError):
            client.pop("q", 0.1)
    finally:
        client.close()
        server.close()


def test_store_queue_is_fifo_and_a_blocked_pop_does_not_block_other_threads():
    before = commsched_threads()
    server = StoreServer("127.0.0.1", 0)
    client = StoreClient(*server.address)
    got = []
    popper = threading.Thread(target=lambda: got.extend(client.pop("q", 10.0) for _ in range(2)))
    popper.start()
    time.sleep(0.1)  # the popper now waits on the server
    start = time.monotonic()
    client.set("k", b"v")  # another thread's call goes through meanwhile
    assert time.monotonic() - start < 2.0
    client.push("q", b"first")
    client.push("q", b"second")
    popper.join(10)
    assert got == [b"first", b"second"]
    client.close()
    server.close()
    assert not [t for t in commsched_threads() - before if t.name.startswith("commsched-store")]


def test_a_closed_store_server_makes_clients_fail_instead_of_wait():
    server = StoreServer("127.0.0.1", 0)
    client = StoreClient(*server.address)
    client.set("a", b"1")
    server.close()
    with pytest.raises(ConnectionError):
        client.get("a", 1.0)
    client.close()


# ------------------------------------------------------------------ KVStore on one worker
def make_net():
    mx.random.seed(3)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, in_units=8, activation="relu"), gluon.nn.Dense(4, in_units=16))
    net.initialize(mx.init.Xavier())
    return net


def train(kv, steps=4, **trainer_args):
    net = make_net()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv,
                            **trainer_args)
    rs = np.random.RandomState(0)
    loss_fn = gluon.loss.L2Loss()
    for _ in range(steps):
        x, y = mx.nd.array(rs.rand(4, 8)), mx.nd.array(rs.rand(4, 4))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(4)
    return [p.data().asnumpy() for p in net.collect_params().values()]


@pytest.mark.parametrize("gate_mode", ["auto", "issue"])
def test_trainer_on_a_local_commsched_store_equals_training_without_a_store(gate_mode):
    reference = train(None)
    with cmx.KVStore("local", SMALL, gate=gate_mode) as kv:
        got = train(kv)
        assert kv.stats()["pieces"] > 4 * 4  # the 16x8 weight is split into 256-byte pieces
        assert kv.stats()["max_in_flight_bytes"] <= 512
    assert all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True))


def test_the_registered_type_and_the_capabilities():
    assert mx.kv.KVStoreBase.kv_registry["commsched"] is cmx.Commsched
    with cmx.KVStore("local", SMALL) as kv:
        assert kv.is_capable("optimizer") is False  # local update by default
        with pytest.raises(ValueError, match="update_on_kvstore=True"):
            kv.set_optimizer(mx.optimizer.SGD())
    with cmx.KVStore("local", SMALL, update_on_kvstore=True) as kv:
        assert kv.is_capable("optimizer") is True


def test_settings_come_from_the_environment_through_scheduler_config(monkeypatch):
    monkeypatch.setenv("COMMSCHED_PARTITION_BYTES", "2KiB")
    monkeypatch.setenv("COMMSCHED_ORDERING", "fifo")
    with cmx.KVStore("local") as kv:
        assert kv.config.partition_bytes == 2048 and kv.config.ordering == "fifo"


def test_update_on_kvstore_needs_the_store_to_allow_it():
    with cmx.KVStore("local", SMALL) as kv:
        with pytest.raises(ValueError, match="update_on_kvstore=False"):
            train(kv, steps=1, update_on_kvstore=True)


def test_misuse_errors_say_how_to_fix_it():
    with pytest.raises(ValueError, match="synchronous"):
        cmx.KVStore("dist_async")
    with pytest.raises(ValueError, match="gate="):
        cmx.KVStore("local", SMALL, gate="sometimes")
    with cmx.KVStore("local", SMALL) as kv:
        a = mx.nd.ones((8,))
        with pytest.raises(ValueError, match="init"):
            kv.pushpull(3, a)
        kv.init(3, a)
        with pytest.raises(ValueError, match="already initialized"):
            kv.init(3, a)
        with pytest.raises(ValueError, match="one context"):
            kv.pushpull(3, [a, a.copy()])
        with pytest.raises(ValueError, match="shape"):
            kv.pushpull(3, mx.nd.ones((9,)))
        with pytest.raises(ValueError, match="dense"):
            kv.init(4, mx.nd.ones((4, 4)).tostype("row_sparse"))
        with pytest.raises(ValueError, match="all int or all str"):
            kv.init("w", a)


def test_close_joins_every_thread_and_every_later_call_raises_scheduler_closed():
    before = commsched_threads()  # other tests in this process may have threads of their own
    kv = cmx.KVStore("local", SMALL)
    a = mx.nd.ones((100,))
    kv.init(0, a)
    kv.pushpull(0, a)
    kv.synchronize()
    kv.close()
    kv.close()  # idempotent
    assert not [t.name for t in commsched_threads() - before]
    calls = {
        "init": lambda: kv.init(1, a),
        "broadcast": lambda: kv.broadcast(1, a, out=a),
        "pushpull": lambda: kv.pushpull(0, a),
        "push": lambda: kv.push(0, a),
        "pull": lambda: kv.pull(0, out=a),
        "synchronize": kv.synchronize,
        "set_optimizer": lambda: kv.set_optimizer(mx.optimizer.SGD()),
    }
    for name, call in calls.items():
        with pytest.raises(commsched.SchedulerClosed, match="closed"):
            call()
            pytest.fail(f"{name} on a closed KVStore did not raise")


def test_the_context_manager_closes_and_keeps_the_exception_that_left_the_block():
    before = commsched_threads()
    with pytest.raises(KeyError, match="from the block"):
        with cmx.KVStore("local", SMALL) as kv:
            kv.init(0, mx.nd.ones((100,)))
            kv.pushpull(0, mx.nd.ones((100,)))
            raise KeyError("from the block")
    assert not [t.name for t in commsched_threads() - before]
    with pytest.raises(commsched.SchedulerClosed):
        kv.pushpull(0, mx.nd.ones((100,)))


def test_pushpull_with_out_leaves_the_value_untouched():
    # ps-lite pulls into the push source; with `out` commsched pushes a copy, so a
    # gradient accumulated with grad_req='add' is not overwritten.
    with cmx.KVStore("local", SMALL) as kv:
        value, out = mx.nd.arange(200), mx.nd.zeros((200,))
        kv.init(0, mx.nd.zeros((200,)))
        kv.pushpull(0, value, out=out)
        kv.synchronize()
        assert (out.asnumpy() == np.arange(200)).all()
        assert (value.asnumpy() == np.arange(200)).all()


def test_the_pieces_of_a_key_are_views_on_its_memory_cut_where_the_scheduler_cuts():
    a = mx.nd.zeros((4, 5))
    with cmx.KVStore("local", commsched.SchedulerConfig(partition_bytes=24)) as kv:  # 6 float32 per piece
        bounds = kv.scheduler.bounds(20, 4)
    entry = KeyEntry("a", a, bounds, first_key=cmx.FIRST_SUB_KEY)
    assert entry.bounds == [(0, 6), (6, 12), (12, 18), (18, 20)]
    assert entry.sub_keys == [cmx.FIRST_SUB_KEY + i for i in range(4)]
    for index, view in enumerate(entry.views(a)):
        view[:] = index + 1
    assert a.asnumpy().ravel().tolist() == [1] * 6 + [2] * 6 + [3] * 6 + [4] * 2


def test_the_backend_closes_twice_without_harm_and_leaves_no_thread():
    # Scheduler.close() closes the backend; a KVStore that failed half-way closes it too.
    before = commsched_threads()
    backend = KVStoreBackend(mx.kv.create("local"), gates=None)  # the fallback's waiter thread
    assert [t.name for t in commsched_threads() - before] == ["commsched-mx-wait-r0"]
    backend.close()
    backend.close()
    assert not commsched_threads() - before


@pytest.mark.parametrize("kwargs, error, message", [
    ({"config": {"partition_bytes": 1024}}, TypeError, r"config must be a commsched.SchedulerConfig, got dict; "
     r"use config=commsched.SchedulerConfig\(\*\*\{'partition_bytes': 1024\}\)"),
    ({"config": 1024}, TypeError,
     r"config must be a commsched.SchedulerConfig, got int; use config=commsched.SchedulerConfig\("),
    ({"kvstore": 3}, TypeError,
     r"kvstore must be a KVStore type name such as 'dist_sync' or an mx.kv.KVStore, got int"),
    ({"update_on_kvstore": "yes"}, TypeError, r"update_on_kvstore='yes' must be True .* or False"),
    ({"update_on_kvstore": 1}, TypeError, r"update_on_kvstore=1 must be True"),
    ({"gate": ["auto"]}, ValueError, r"gate=\['auto'\] is not one of auto, engine, issue"),
    ({"config": commsched.SchedulerConfig(priority="slack")}, ValueError,
     r"priority='slack' is computed by the PyTorch DistributedOptimizer .* the MXNet KVStore ranks pieces by layer"),
])
def test_bad_constructor_arguments_name_the_argument_and_the_fix_before_any_store_or_thread(
        kwargs, error, message, monkeypatch):
    from commsched.plugins.mxnet import kvstore as kvstore_mod

    # the checks come first: a ps-lite store (dist_sync would wait for a scheduler) is never made
    monkeypatch.setattr(kvstore_mod, "sync_kvstore", None)
    before = commsched_threads()
    args = {"kvstore": "dist_sync", **kwargs}
    with pytest.raises(error, match=message):
        cmx.KVStore(args.pop("kvstore"), **args)
    assert commsched_threads() == before


def test_gluon_drops_a_one_context_string_kvstore_without_dist_so_the_trainer_string_is_dist_commsched():
    # Why "dist_commsched" exists: MXNet 1.9.1's Gluon creates a string kvstore for one
    # context only when the name contains "dist", so kvstore="commsched" trains alone.
    assert mx.kv.KVStoreBase.kv_registry["dist_commsched"] is cmx.Dist_Commsched
    assert mx.kv.KVStoreBase.kv_registry["commsched"] is cmx.Commsched
    assert issubclass(cmx.Dist_Commsched, cmx.Commsched) and "dist" in "dist_commsched"
    net = gluon.nn.Dense(4, in_units=3)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="commsched")
    with autograd.record():
        loss = net(mx.nd.ones((2, 3))).sum()
    loss.backward()
    trainer.step(2)
    assert trainer._kvstore is None  # no store, no communication, no error: what the docs warn about
