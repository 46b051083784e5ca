"""The TensorFlow plugin in one process: keys, graph structure, wrappers and their errors.

Collectives with a group of one run locally, so the graph that commsched writes
(tokens, chains, instance keys) is checked here without a cluster.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import commsched  # noqa: E402
from commsched.errors import HorovodUnavailable, SchedulerClosed  # noqa: E402
from commsched.plugins.tensorflow import DistributedGradientTape, DistributedOptimizer, unroll  # noqa: E402
from commsched.plugins.tensorflow import keys  # noqa: E402
from commsched.plugins.tensorflow.backends import ReplicaGroup  # noqa: E402
from commsched.plugins.tensorflow.reduction import (  # noqa: E402
    GradientReducer,
    fusion_groups,
    is_reduced,
    slots_for,
    variable_name,
)

pytestmark = pytest.mark.timeout(120)

# fusion off: these tests read the chains of tiny gradients (test_small_gradients_... turns it on)
CONFIG = commsched.SchedulerConfig(partition_bytes=64, credit_bytes=192, fusion_bytes=0, timeout_s=30)


def _keys(n):
    start = keys.reserve(n)
    return tf.stack([keys.instance_key(start, k) for k in range(n)])


def test_keys_are_drawn_per_run_so_calls_functions_and_retraces_never_clash():
    @tf.function
    def f(x):
        return _keys(3) + tf.cast(0 * tf.size(x), tf.int32)

    @tf.function
    def g():
        return _keys(2)

    before = keys.counter_value()
    drawn = [f(tf.zeros([1])), g(), f(tf.zeros([1])), f(tf.zeros([2, 2])), g(), _keys(1)]  # f retraces, then eager
    assert f.experimental_get_tracing_count() == 2
    flat = [int(k) for keys_ in drawn for k in keys_.numpy()]
    assert len(flat) == len(set(flat)) == 3 + 2 + 3 + 3 + 2 + 1 == keys.counter_value() - before
    assert all(keys.FIRST_INSTANCE_KEY <= k < 2**31 for k in flat)


def test_an_inner_function_called_twice_in_an_outer_one_draws_new_keys_each_time():
    @tf.function
    def inner():
        return _keys(2)

    @tf.function
    def outer():
        return tf.concat([inner(), inner()], 0)

    first, second = outer().numpy(), outer().numpy()
    assert len(set(first) | set(second)) == 8


def test_keys_wrap_around_below_int32():
    start = tf.constant(keys.KEY_RANGE - 1, tf.int64)
    assert int(keys.instance_key(start, 0)) == keys.FIRST_INSTANCE_KEY + keys.KEY_RANGE - 1 == 2**31 - 2
    assert int(keys.instance_key(start, 1)) == keys.FIRST_INSTANCE_KEY


def test_reductions_inside_a_while_loop_are_refused_with_the_fix():
    @tf.function
    def loop():
        return tf.while_loop(lambda i: i < 2, lambda i: i + tf.cast(keys.reserve(1), tf.int32) * 0 + 1, [0])

    with pytest.raises(ValueError, match="unroll"):
        loop()


def _local_reduce(reducer, values):
    group = ReplicaGroup(1, 0, "/device:CPU:0")
    return reducer._reduce_dense(values, [f"v{i}" for i in range(len(values))], group)


def test_graph_holds_k_token_chains_in_plan_order_and_results_are_exact():
    reducer = GradientReducer(CONFIG)
    assert reducer.slots == slots_for(CONFIG) == 3
    values = [tf.random.stateless_normal(shape, seed=[1, i]) for i, shape in enumerate([(10, 4), (4,), (4, 3), (3,)])]

    @tf.function
    def step(*vs):
        return _local_reduce(reducer, list(vs))

    out = step(*values)
    for a, b in zip(out, values, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # a sum over one replica
    plan = reducer.plans[-1]
    assert len(plan.pieces) == 3 + 1 + 1 + 1  # the 160-byte kernel in 64-byte pieces
    graph = step.get_concrete_function(*values).graph
    ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert [op.name.split("commsched_")[-1] for op in ops] == [p.name.replace(":", "_").replace("#", "_")
                                                                for p in plan.pieces]
    chains: dict = {}
    for op, piece in zip(ops, plan.pieces, strict=True):
        chains.setdefault(op.inputs[4].name, []).append((op, piece.slot))
    assert len(chains) == 3
    for chain in chains.values():
        assert len({slot for _, slot in chain}) == 1  # one token per planned slot
        for (before, _), (after, _) in zip(chain, chain[1:], strict=False):
            assert before in after.control_inputs
    # Each run draws one instance key per piece, new every time.
    before = keys.counter_value()
    step(*values)
    assert keys.counter_value() - before == len(plan.pieces)


def test_small_gradients_go_fused_off_the_chains_and_results_are_exact():
    # 160 B and 48 B kernels are large here (>= 32 B), the 16 B and 12 B biases small: one fused piece.
    config = dataclasses.replace(CONFIG, fusion_bytes=32)
    reducer = GradientReducer(config)
    shapes = [(10, 4), (4,), (4, 3), (3,)]
    values = [tf.random.stateless_normal(shape, seed=[2, i]) for i, shape in enumerate(shapes)]
    assert fusion_groups([160, 16, 48, 12], [tf.float32] * 4, 32) == [[1, 3]]

    @tf.function
    def step(*vs):
        return _local_reduce(reducer, list(vs))

    out = step(*values)
    for a, b in zip(out, values, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # a sum over one replica, split back in place
    plan = reducer.plans[-1]
    assert [p.name for p in plan.pieces] == ["v2#0", "v0#0", "v0#1", "v0#2", "fused[v1..v3](2)#0"]
    fused = plan.pieces[-1]
    assert (fused.nbytes, fused.slot, fused.priority) == (28, -1, 1)
    assert {p.slot for p in plan.pieces[:-1]} <= set(range(reducer.slots))
    graph = step.get_concrete_function(*values).graph
    ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert len(ops) == len(plan.pieces)
    tokens = [op.inputs[4].name for op in ops]
    assert tokens.count(tokens[-1]) == 1  # a token of its own: chained to no other piece
    assert not any(op in ops[-1].control_inputs for op in ops[:-1])
    assert not any(ops[-1] in op.control_inputs for op in ops[:-1])  # and it holds up no large piece
    assert reducer.settings()["fusion_bytes"] == 32
    # fusion_bytes=0: no group, every gradient on the chains
    assert fusion_groups([160, 16, 48, 12], [tf.float32] * 4, 0) == []


def test_fusion_groups_walk_backward_split_by_size_and_dtype():
    f32, f16 = tf.float32, tf.float16
    # forward order; backward starts from the end: the last gradients group first
    assert fusion_groups([8, 100, 8, 8, 100, 8], [f32] * 6, 20) == [[3, 5], [0, 2]]
    assert fusion_groups([8, 8, 8, 8], [f32, f16, f32, f16], 100) == [[1, 3], [0, 2]]
    assert fusion_groups([0, 8, 20, 30], [f32] * 4, 20) == [[1]]  # empty and >= the threshold: not fused


def test_zero_size_gradients_pass_through_between_others():
    reducer = GradientReducer(CONFIG)
    values = [tf.ones([20]), tf.zeros([0, 3]), tf.fill([5], 2.0), tf.zeros([0])]
    out = tf.function(lambda *vs: _local_reduce(reducer, list(vs)))(*values)
    for a, b in zip(out, values, strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_with_one_replica_nothing_is_communicated():
    reducer = GradientReducer(CONFIG)
    grads = [tf.ones([3]), None]
    out = reducer.reduce(grads)  # the default strategy: one replica
    np.testing.assert_array_equal(out[0].numpy(), np.ones(3))
    assert out[1] is None and is_reduced(out[0])
    assert not reducer.plans  # one replica: no collective at all


def _keras():
    return pytest.importorskip("keras")


def test_wrapper_keeps_the_users_optimizer_class_and_config():
    keras = _keras()
    adam = keras.optimizers.Adam(3e-3, beta_1=0.8)
    opt = DistributedOptimizer(adam, config=CONFIG)
    assert isinstance(opt, keras.optimizers.Adam) and type(opt) is not keras.optimizers.Adam
    assert opt.get_config() == adam.get_config()
    assert type(DistributedOptimizer(keras.optimizers.Adam(), config=CONFIG)) is type(opt)  # one class per base


def test_keras3_training_with_one_replica_matches_the_plain_optimizer():
    keras = _keras()

    def train(wrap):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(2)])
        opt = keras.optimizers.Adam(1e-2)
        opt = DistributedOptimizer(opt, config=CONFIG) if wrap else opt

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        for s in range(3):
            step(tf.random.stateless_normal((6, 5), seed=[s, 0]))
        return model.get_weights(), int(opt.iterations.numpy())

    (plain, n_plain), (ours, n_ours) = train(False), train(True)
    assert n_plain == n_ours == 3
    for a, b in zip(plain, ours, strict=True):
        np.testing.assert_array_equal(a, b)


def test_misuse_errors_say_how_to_fix_it():
    keras = _keras()
    with pytest.raises(TypeError, match="Keras optimizer"):
        DistributedOptimizer(object())
    used = keras.optimizers.SGD(0.1)
    used.build([keras.Variable(np.zeros(2, "float32"))])
    with pytest.raises(ValueError, match="before the first step"):
        DistributedOptimizer(used)
    with pytest.raises(TypeError, match="SchedulerConfig"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), config={"partition_bytes": 1})
    with pytest.raises(ValueError, match="collective"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), backend="nccl")
    with pytest.raises(TypeError, match="GradientTape"):
        DistributedGradientTape(object())
    with pytest.raises(ValueError, match="mean"):
        DistributedGradientTape(tf.GradientTape(), op="max")
    with pytest.raises(ValueError, match="n >= 1"):
        unroll(lambda: None, 0)


def test_a_keras_without_the_hook_is_refused_instead_of_silently_reducing_twice():
    keras = _keras()

    class Hookless(keras.optimizers.SGD):
        _all_reduce_sum_gradients = None

    with pytest.raises(TypeError, match="_all_reduce_sum_gradients"):
        DistributedOptimizer(Hookless(0.1))


def test_legacy_tf_keras_optimizers_are_refused():
    tf_keras = pytest.importorskip("tf_keras")
    with pytest.raises(TypeError, match="legacy"):
        DistributedOptimizer(tf_keras.optimizers.legacy.SGD(0.1))


def test_a_missing_horovod_raises_horovod_unavailable_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)  # import fails as if not installed
    for wrap in (lambda: GradientReducer(CONFIG, backend="horovod"),
                 lambda: DistributedGradientTape(tf.GradientTape(), config=CONFIG, backend="horovod"),
                 lambda: DistributedOptimizer(_keras().optimizers.SGD(0.1), config=CONFIG, backend="horovod")):
        with pytest.raises(HorovodUnavailable, match="HOROVOD_WITH_TENSORFLOW") as info:
            wrap()
        assert isinstance(info.value, ImportError) and "ENVIRONMENT.md" not in str(info.value)


def test_a_subclass_of_the_wrapped_tape_reduces_once_without_recursing():
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    wrapped = DistributedGradientTape(tape, config=CONFIG)
    calls = []

    class Logged(type(wrapped)):
        def gradient(self, target, sources, **kw):
            calls.append(len(sources))
            return super().gradient(target, sources, **kw)

    logged = Logged.__new__(Logged)
    logged.__dict__.update(wrapped.__dict__)
    grads = logged.gradient(loss, [v])
    np.testing.assert_array_equal(grads[0].numpy(), [2.0, 4.0])
    assert calls == [1] and is_reduced(grads[0])


def test_tape_and_reducer_name_pieces_after_variables_the_same_way():
    v = tf.Variable([1.0], name="kernel")
    assert variable_name(v, 3) == f"3:{getattr(v, 'path', None) or 'kernel'}"  # without TF's ":0"
    assert variable_name(object(), 2) == variable_name(None, 2) == "grad2"
    reducer = GradientReducer(CONFIG)
    seen = []
    reducer.reduce = lambda grads, names=None: seen.append(names) or grads
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    wrapped = DistributedGradientTape(tape, config=CONFIG)
    wrapped.commsched = reducer
    wrapped.gradient(loss, [v])
    reducer.reduce_grads_and_vars([(tf.ones([1]), v)])
    assert seen == [[variable_name(v, 0)], [variable_name(v, 0)]]


def test_closed_optimizer_and_tape_refuse_work_with_scheduler_closed():
    keras = _keras()
    v = keras.Variable(np.ones(2, "float32"))
    with DistributedOptimizer(keras.optimizers.SGD(0.1), config=CONFIG) as opt:
        opt.apply_gradients([(tf.ones([2]), v)])
        np.testing.assert_allclose(v.numpy(), [0.9, 0.9])
    opt.close()  # idempotent
    with pytest.raises(SchedulerClosed, match="closed"):
        opt.apply_gradients([(tf.ones([2]), v)])
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    tape = DistributedGradientTape(tape, config=CONFIG)
    tape.close()
    tape.close()
    with pytest.raises(SchedulerClosed, match="closed"):
        tape.gradient(loss, [w])


def test_tape_returns_gradients_marked_as_reduced_and_unroll_runs_n_steps():
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    grads = DistributedGradientTape(tape, config=CONFIG).gradient(loss, [v])
    np.testing.assert_array_equal(grads[0].numpy(), [2.0, 4.0])
    assert is_reduced(grads[0])
    counter = tf.Variable(0)
    results = unroll(lambda: tf.identity(counter.assign_add(1)), 3)()
    assert [int(r) for r in results] == [1, 2, 3]


@pytest.mark.parametrize("make", ["optimizer", "tape"])
@pytest.mark.parametrize("kwargs, error, message", [
    ({"config": {"credit_bytes": 4096}}, TypeError, r"config must be a commsched.SchedulerConfig, got dict; "
     r"use config=commsched.SchedulerConfig\(\*\*\{'credit_bytes': 4096\}\)"),
    ({"config": 4096}, TypeError, r"got int; use config=commsched.SchedulerConfig\(partition_bytes=\.\.\."),
    ({"backend": 1}, TypeError, r"backend must be a str \('collective' or 'horovod'\), got int"),
    ({"backend": "nccl"}, ValueError, r"backend='nccl' is not a TensorFlow backend; use one of"),
    ({"config": commsched.SchedulerConfig(priority="slack")}, ValueError,
     r"priority='slack' is computed by the PyTorch DistributedOptimizer .*TensorFlow ranks pieces by layer order"),
])
def test_bad_constructor_arguments_name_the_argument_and_the_fix(make, kwargs, error, message):
    import threading

    before = set(threading.enumerate())
    with pytest.raises(error, match=message):
        if make == "optimizer":
            DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **kwargs)
        else:
            with tf.GradientTape() as tape:
                pass
            DistributedGradientTape(tape, **kwargs)
    assert set(threading.enumerate()) == before  # nothing started
