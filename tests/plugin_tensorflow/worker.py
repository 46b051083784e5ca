"""One worker of a 2-worker TensorFlow test job (started by tests/plugin_tensorflow/launch.py).

Usage: TF_CONFIG=... python worker.py SCENARIO OUT_JSON

Each scenario trains the same model twice in this process, once with stock
``MultiWorkerMirroredStrategy`` all-reduce and once with commsched, from the same
initial weights on the same data, and writes what the test asserts on to OUT_JSON.
Scenarios:

* ``keras3``: Keras 3 custom loops (SGD with momentum, Adam), ``unroll``, the
  gradient tape, two compiled functions plus a retrace, and the graph structure;
* ``tf_keras``: tf-keras ``model.fit`` (run with TF_USE_LEGACY_KERAS=1) and a tf-keras
  custom loop;
* ``die``: rank 1 leaves after one step; rank 0 must fail with a commsched error;
* ``kill``: the victim (``COMMSCHED_TEST_VICTIM``, default 1) SIGKILLs itself from a timer a
  fraction into its third step (``COMMSCHED_TEST_FRACTION``); the survivor must fail with a
  commsched error;
* ``planned``: ``ordering="planned"`` with a plan made from the model's variables (per-group
  piece sizes, a fused group, its own order, one piece "hierarchical"), against stock; then a
  plan for another model, and a plan that differs on rank 1 (both must fail on both workers).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

import numpy as np

SCENARIO, OUT = sys.argv[1], sys.argv[2]
RANK = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
WORLD = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import commsched  # noqa: E402
from commsched.plugins.tensorflow import DistributedGradientTape, DistributedOptimizer, function, unroll  # noqa: E402
from commsched.plugins.tensorflow import keys  # noqa: E402
from commsched.timeline import rank_path  # noqa: E402

# Pieces of 1 KiB (256 floats) and a 4 KiB credit: the 20x48 kernel (3840 bytes) is cut in 4
# pieces, and K = 4 slots. Fusion off: the chain tests read every gradient on the chains.
CONFIG = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, fusion_bytes=0, timeout_s=60)
# With fusion: the two biases (192 and 40 bytes) go as one piece off the chains.
FUSED = dataclasses.replace(CONFIG, fusion_bytes=1024)
LOCAL_BATCH = 8
GLOBAL_BATCH = LOCAL_BATCH * WORLD
STEPS = 4

result: dict = {"rank": RANK}


def data(step: int, rank: int = RANK) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal((LOCAL_BATCH, 20)).astype("float32")
    y = rng.integers(0, 10, LOCAL_BATCH).astype("int32")
    return x, y


def make_model(keras):
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(48, activation="relu"),
                              keras.layers.Dense(10)])
    return model


def same_weights(a, b, init) -> dict:
    """Whether ``b`` (commsched) ended bitwise equal to ``a`` (stock), and how far training moved
    each from the initial weights ``init`` (0 would mean nothing was trained)."""
    wa, wb = a.get_weights(), b.get_weights()
    return {"bitwise": all(np.array_equal(x, y) for x, y in zip(wa, wb, strict=True)),
            "max_abs_diff": float(max(np.max(np.abs(x - y)) for x, y in zip(wa, wb, strict=True))),
            "moved": float(max(np.max(np.abs(x - w0)) for x, w0 in zip(wb, init, strict=True))),
            "ref_moved": float(max(np.max(np.abs(x - w0)) for x, w0 in zip(wa, init, strict=True))),
            "every_variable_moved": all(bool(np.any(x != w0)) for x, w0 in zip(wb, init, strict=True))}


def error_record(exc: BaseException) -> dict:
    """What the survivor of a lost worker saw: the class, commsched's or not, and the chained TF error."""
    cause = exc.__cause__
    return {"error": f"{type(exc).__name__}: {str(exc)[:500]}", "type": type(exc).__name__,
            "is_commsched": isinstance(exc, commsched.CommschedError),
            "is_communication_error": isinstance(exc, commsched.CommunicationError),
            "is_timeout": isinstance(exc, commsched.CommschedTimeout),
            "cause_type": None if cause is None else type(cause).__name__,
            "cause_is_tf": isinstance(cause, tf.errors.OpError),
            "tensor": getattr(exc, "tensor", None), "piece": getattr(exc, "piece", None),
            "pending": list(getattr(exc, "pending", []) or [])}


def custom_loop(strategy, keras, make_opt, wrap: bool, steps=STEPS, unrolled: int = 0, init=None, config=CONFIG):
    """Train with a custom loop; stock all-reduce when not wrap, commsched when wrap (``config``
    may be a function of the model, for a plan made from its variables)."""
    with strategy.scope():
        model = make_model(keras)
        if init is not None:
            model.set_weights(init)
        opt = make_opt()
        if wrap:
            opt = DistributedOptimizer(opt, config=config(model) if callable(config) else config)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    if unrolled:
        batches = [data(s) for s in range(steps)]

        def one(it):
            x, y = next(it)
            return strategy.run(train_step, args=(x, y))

        run = unroll(one, unrolled)
        ds = tf.data.Dataset.from_tensor_slices(
            (np.stack([b[0] for b in batches]), np.stack([b[1] for b in batches])))
        it = iter(ds)
        for _ in range(steps // unrolled):
            run(it)
        return model, opt, run

    @tf.function
    def step(x, y):
        return strategy.run(train_step, args=(x, y))

    for s in range(steps):
        step(*data(s))
    return model, opt, step


def _ancestors(op) -> set:
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def graph_structure(fn, plan, *args) -> dict:
    """Token chains of commsched's collectives in a traced step, and what each update waits for."""
    graph = fn.get_concrete_function(*args).graph
    ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"
           and op.name.split("/")[-1].startswith("commsched_")]
    tokens = {}
    for op in ops:
        token = op.inputs[4]  # input, group_size, group_key, instance_key, ordering_token
        tokens.setdefault(token.name, []).append(op)
    chained = True
    for chain in tokens.values():
        for before, after in zip(chain, chain[1:], strict=False):
            chained &= before in after.control_inputs
    # Every update of a variable (or of its slot variables) may wait for the pieces up to its
    # own last one in the plan (they share slots), never for a later piece.
    position = {op: k for k, op in enumerate(ops)}  # creation order = plan order
    last_own = {}
    for k, piece in enumerate(plan.pieces):
        last_own[piece.tensor] = k
    # The test model's variables all differ in size, so a size names the variable.
    numel_to_tensor = {pieces[-1].stop: i for i, pieces in enumerate(plan.by_tensor())}
    updates = []
    for op in graph.get_operations():
        if op.type not in ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp"):
            continue
        value = op.inputs[1]
        if not value.shape.is_fully_defined() or value.shape.num_elements() not in numel_to_tensor:
            continue
        tensor = numel_to_tensor[value.shape.num_elements()]
        waits = sorted(position[a] for a in _ancestors(op) if a in position)
        if waits:
            updates.append({"op": op.name, "tensor": tensor, "last_wait": waits[-1], "last_own": last_own[tensor]})
    return {"collectives": len(ops), "tokens": len(tokens), "chained": chained,
            "names": [op.name.split("/")[-1] for op in ops], "updates": updates}


def scenario_keras3() -> None:
    import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result["keras"] = keras.__version__
    with strategy.scope():
        init = make_model(keras).get_weights()
    t0 = time.time()
    timeline = dataclasses.replace(CONFIG, timeline=os.path.join(os.path.dirname(OUT), "timeline.json"))
    refs = {}
    for name, make_opt in [("sgd_momentum", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
                           ("adam", lambda: keras.optimizers.Adam(1e-2))]:
        ref, ref_opt, _ = custom_loop(strategy, keras, make_opt, wrap=False, init=init)
        refs[name] = ref
        ours, opt, step = custom_loop(strategy, keras, make_opt, wrap=True, init=init,
                                      config=timeline if name == "adam" else FUSED)
        result[name] = same_weights(ref, ours, init)
        result[name]["off_chain"] = [p.name for p in opt.commsched.plans[-1].pieces if p.slot < 0]
        result[name]["iterations"] = int(opt.iterations.numpy())
        result[name]["ref_iterations"] = int(ref_opt.iterations.numpy())
        if name == "adam":
            plan = opt.commsched.plans[-1]
            result["graph"] = graph_structure(step, plan, *data(0))
            result["plan_order"] = plan.order
            result["plan_slots"] = [p.slot for p in plan.pieces]
            result["slots"] = opt.commsched.slots
            record = opt.commsched.records[-1]
            result["measured"] = {"count": record.recorder.count, "order": list(record.plan.order),
                                  "runs": [{"start": r.start, "ready": r.ready.tolist(), "done": r.done.tolist()}
                                           for r in record.recorder.runs()]}
            result["report"] = opt.report()
            result["stats"] = opt.commsched.stats()
            result["timeline"] = rank_path(timeline.timeline, RANK, WORLD)
    result["custom_loop_s"] = time.time() - t0

    # unroll: 2 steps per function, against the stock loop of the same 4 steps.
    t0 = time.time()
    make_adam = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    ours, opt, _ = custom_loop(strategy, keras, make_adam, wrap=True, unrolled=2, init=init)
    result["unroll"] = same_weights(refs["adam"], ours, init)
    result["unroll"]["iterations"] = int(opt.iterations.numpy())
    result["unroll_s"] = time.time() - t0

    # ordering="static": unroll()'s function traces the step again at call RETRACE_AT_CALL (4, the
    # last of the 4 steps here), planned from the order the first trace measured, worker 0's for both.
    from commsched.plugins.tensorflow.functions import RETRACE_AT_CALL
    from commsched.plugins.tensorflow.reduction import static_pending

    assert STEPS >= RETRACE_AT_CALL
    static = dataclasses.replace(CONFIG, ordering="static")
    ours, opt, _ = custom_loop(strategy, keras, make_adam, wrap=True, unrolled=1, init=init, config=static)
    result["static"] = same_weights(refs["adam"], ours, init)
    result["static"].update(traces=len(opt.commsched.plans), pending=static_pending(),
                            orders=[list(p.order) for p in opt.commsched.plans])

    # DistributedGradientTape, op="mean": the mean over workers of each worker's own mean loss,
    # applied by a DistributedOptimizer (which must not reduce them again).
    # op="sum" with a Keras 3 loss object (which, inside strategy.run, already divides by the
    # number of replicas), applied by a hand-written SGD.
    t0 = time.time()
    with strategy.scope():
        tape_model = make_model(keras)
        tape_model.set_weights(init)
        tape_opt = DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), config=CONFIG)
        hand_model = make_model(keras)
        hand_model.set_weights(init)
    per_example_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    scaled_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def tape_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_fn(y, tape_model(x, training=True)))  # this worker's mean
        tape = DistributedGradientTape(tape, config=CONFIG)
        grads = tape.gradient(loss, tape_model.trainable_variables)
        tape_opt.apply_gradients(zip(grads, tape_model.trainable_variables, strict=True))

    def hand_step(x, y):
        with tf.GradientTape() as tape:
            loss = scaled_fn(y, hand_model(x, training=True))
        tape = DistributedGradientTape(tape, config=CONFIG, op="sum")
        grads = tape.gradient(loss, hand_model.trainable_variables)
        for g, v in zip(grads, hand_model.trainable_variables, strict=True):
            v.assign_sub(0.1 * g)

    run_tape = tf.function(lambda x, y: strategy.run(tape_step, args=(x, y)))
    run_hand = tf.function(lambda x, y: strategy.run(hand_step, args=(x, y)))
    drawn = [keys.counter_value()]
    for s in range(STEPS):  # two compiled functions, alternating
        run_tape(*data(s))
        drawn.append(keys.counter_value())
        run_hand(*data(s))
        drawn.append(keys.counter_value())
    # Reference: the stock loop on the same data (its loss is divided by the global batch and
    # summed, which is the mean of the workers' mean gradients).
    result["tape"] = same_weights(refs["sgd_momentum"], tape_model, init)
    result["tape"]["iterations"] = int(tape_opt.iterations.numpy())
    ref_hand = custom_loop(strategy, keras, lambda: keras.optimizers.SGD(0.1), wrap=False, init=init)[0]
    result["hand"] = same_weights(ref_hand, hand_model, init)
    # A retrace (another batch size) of a function that was already called, then the other one again.
    x, y = data(STEPS)
    run_tape(x[:4], y[:4])
    drawn.append(keys.counter_value())
    run_hand(x, y)
    drawn.append(keys.counter_value())
    result["retraced"] = run_tape.experimental_get_tracing_count()
    result["keys_drawn"] = drawn  # the counter after each call: each call draws its own block
    result["tape_s"] = time.time() - t0


def scenario_tf_keras() -> None:
    import tf_keras

    assert tf.keras is tf_keras or tf.keras.__name__.startswith("tf_keras"), tf.keras
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result["keras"] = tf_keras.__version__
    xs = np.concatenate([data(s, r)[0] for s in range(STEPS) for r in range(WORLD)])
    ys = np.concatenate([data(s, r)[1] for s in range(STEPS) for r in range(WORLD)])
    with strategy.scope():
        init = make_model(tf_keras).get_weights()
    t0 = time.time()
    for name, make_opt in [("sgd_momentum", lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9)),
                           ("adam", lambda: tf_keras.optimizers.Adam(1e-2))]:
        models = []
        for wrap in (False, True):
            with strategy.scope():
                model = make_model(tf_keras)
                model.set_weights(init)
                opt = make_opt()
                if wrap:
                    opt = DistributedOptimizer(opt, config=CONFIG)
                model.compile(optimizer=opt,
                              loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(GLOBAL_BATCH)
            model.fit(ds, epochs=1, steps_per_epoch=STEPS, verbose=0)
            models.append((model, opt))
        result[name] = same_weights(models[0][0], models[1][0], init)
        result[name]["iterations"] = int(models[1][1].iterations.numpy())
        result[name]["traces"] = len(models[1][1].commsched.plans)
    result["fit_s"] = time.time() - t0
    # tf-keras custom loop with the same wrapper.
    ref, _, _ = custom_loop(strategy, tf_keras, lambda: tf_keras.optimizers.Adam(1e-2), wrap=False, init=init)
    ours, opt, _ = custom_loop(strategy, tf_keras, lambda: tf_keras.optimizers.Adam(1e-2), wrap=True, init=init)
    result["custom_loop"] = same_weights(ref, ours, init)
    result["custom_loop"]["iterations"] = int(opt.iterations.numpy())


def _lost_worker_job(timeout_s: float):
    """A model, a DistributedOptimizer and a step compiled with commsched's ``function``."""
    import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, timeout_s=timeout_s)
    with strategy.scope():
        model = make_model(keras)
        opt = DistributedOptimizer(keras.optimizers.SGD(0.1), config=config)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    return function(lambda x, y: strategy.run(train_step, args=(x, y)))


def scenario_die() -> None:
    step = _lost_worker_job(timeout_s=10)
    step(*data(0))
    # Rank 1 leaves only once rank 0 has finished step 0 too: rank 0 may still be receiving that
    # step's last buffer from rank 1 (a RecvBuf served by rank 1), and a death then fails step 0,
    # before the loop below that is the survivor's test (seen once in a clean-clone run).
    step0_done = OUT.replace(f".{RANK}.json", ".0.step0")
    if RANK == 0:
        with open(step0_done, "w") as fh:
            fh.write("done")
    if RANK == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(step0_done) and time.monotonic() < deadline:
            time.sleep(0.05)
        result["left"] = True
        write()
        if os.environ.get("COMMSCHED_TEST_HANG"):
            # Alive but silent (only the collectives' timeout can tell) until rank 0 reported.
            peer = OUT.replace(".1.json", ".0.json")
            deadline = time.monotonic() + 90
            while not os.path.exists(peer) and time.monotonic() < deadline:
                time.sleep(0.2)
        os._exit(0)  # a worker dies: no goodbye to the others
    t0 = time.time()
    result["error"] = None
    try:
        for s in range(1, 4):
            step(*data(s))
            time.sleep(0.5)  # let rank 1 be gone
    except Exception as exc:  # what the survivor sees
        result.update(error_record(exc))
    result["fail_after_s"] = time.time() - t0


def scenario_kill() -> None:
    import signal
    import threading

    victim = int(os.environ.get("COMMSCHED_TEST_VICTIM", "1"))
    fraction = float(os.environ.get("COMMSCHED_TEST_FRACTION", "0.5"))
    step = _lost_worker_job(timeout_s=5)
    step_s = 0.05
    result["error"] = None
    try:
        for s in range(8):
            if s == 3 and RANK == victim:
                def kill(delay: float = fraction * step_s) -> None:
                    time.sleep(delay)
                    with open(OUT + ".killed", "w") as fh:
                        fh.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Thread(target=kill, name="test-kill-timer", daemon=True).start()
            t0 = time.monotonic()
            step(*data(s))
            if s >= 1:
                step_s = time.monotonic() - t0
            if s == 3 and RANK == victim:
                time.sleep(10)  # the timer fires within this step's time in any case
    except Exception as exc:
        result.update(error_record(exc))
    result["time"] = time.time()


def make_test_plan(model, *, order=None, shape_change=False):
    """kernel0 (20x48) in 1 KiB pieces, kernel1 (48x10) in 768-byte pieces, both biases fused; an
    order of the plan's own, with one piece "hierarchical" (run as ring on TF, with a warning)."""
    from commsched.plan import Plan, PlanGroup, PlannedPiece, PlannedTensor, fused_name
    from commsched.plugins.tensorflow import plan_model

    entries = plan_model(model.trainable_variables)
    if shape_change:  # another model with as many elements: kernel1 as 10x48
        e = entries[2]
        entries[2] = PlannedTensor(e.name, e.numel, e.element_size, (10, 48), e.dtype)
    k0, b0, k1, b1 = (e.name for e in entries)
    small = fused_name([b0, b1])
    groups = (PlanGroup(k0, (k0,), 1024), PlanGroup(small, (b0, b1), 4096), PlanGroup(k1, (k1,), 768))
    order = order or [(k1, 2), (small, 0), (k0, 3), (k1, 1), (k0, 0), (k0, 2), (k1, 0), (k0, 1)]
    pieces = tuple(PlannedPiece(t, i, "hierarchical" if (t, i) == (k0, 1) else "ring") for t, i in order)
    return Plan(model=tuple(entries), groups=groups, pieces=pieces, credit_bytes=2048, nodes=1, ranks_per_node=WORLD)


def scenario_planned() -> None:
    import logging

    import keras

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("commsched.plugins.tensorflow.reduction").addHandler(Collect(logging.WARNING))
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        init = make_model(keras).get_weights()
    make_opt = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    ref, _, _ = custom_loop(strategy, keras, make_opt, wrap=False, init=init)
    plans = []

    def planned(model, **kw):
        plans.append(make_test_plan(model, **kw))
        return commsched.SchedulerConfig(ordering="planned", plan=plans[-1], timeout_s=60)

    t0 = time.time()
    ours, opt, step = custom_loop(strategy, keras, make_opt, wrap=True, init=init, config=planned)
    result["planned"] = same_weights(ref, ours, init)
    result["planned"]["iterations"] = int(opt.iterations.numpy())
    result["planned"]["plan_order"] = list(plans[-1].piece_names)
    result["planned"]["graph_order"] = opt.commsched.plans[-1].order
    result["planned"]["graph"] = graph_structure(step, opt.commsched.plans[-1], *data(0))
    result["planned"]["sizes"] = [p.nbytes for p in opt.commsched.plans[-1].pieces]
    result["planned"]["slots"] = opt.commsched.slots
    result["planned"]["warnings"] = warnings
    result["planned_s"] = time.time() - t0

    # A plan for another model, and a plan that differs on rank 1: every worker must refuse.
    def swapped(model):
        config = planned(model)
        if RANK == 0:
            return config
        order = list(config.plan.pieces)
        order[0], order[1] = order[1], order[0]
        return planned(model, order=[(p.task, p.index) for p in order])

    from commsched.plan import PlanMismatch

    for name, config in [("other_model", lambda m: planned(m, shape_change=True)), ("differs", swapped)]:
        t0 = time.time()
        try:
            custom_loop(strategy, keras, make_opt, wrap=True, init=init, config=config, steps=1)
            result[name] = {"error": None}
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {exc}",
                            "is_plan_mismatch": isinstance(exc, PlanMismatch)}
        result[name]["seconds"] = time.time() - t0


def write() -> None:
    tmp = OUT + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(tmp, OUT)


if __name__ == "__main__":
    try:
        {"keras3": scenario_keras3, "tf_keras": scenario_tf_keras, "die": scenario_die, "kill": scenario_kill,
         "planned": scenario_planned}[SCENARIO]()
    except BaseException:
        result["crash"] = traceback.format_exc()
    write()
    sys.stdout.flush()
    # Leave without waiting for the other worker (MWMS may otherwise block at exit).
    os._exit(0)
