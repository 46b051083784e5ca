"""TensorFlow's errors of commsched's pieces reach the user as commsched's errors.

The mapping is checked on TF errors as TensorFlow words them (the node named in the
message); a real timeout while a function is traced runs in a subprocess, because a
timed-out collective aborts TensorFlow's collective executor for the whole process.
The lost-worker tests on two workers are in test_multiworker.py and test_faults.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

tf = pytest.importorskip("tensorflow")

from commsched.errors import CommschedError, CommschedTimeout, CommunicationError  # noqa: E402
from commsched.plugins.tensorflow import function  # noqa: E402
from commsched.plugins.tensorflow.failures import TracedTimeout, commsched_error, register_op  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent


def _tf_error(cls, node: str):
    message = ("{{function_node __inference_step_283}} Collective ops is aborted by: recvmsg:Connection reset by "
               f"peer\nThe error could be from a previous operation.\n\t [[{{{{node {node}}}}}]] [Op:__inference_step]")
    return cls(None, None, message)


def test_a_lost_peer_in_a_commsched_piece_is_a_communication_error_naming_tensor_and_piece():
    register_op("sgd/commsched_2_dense_kernel_1", "2:dense/kernel#1", 0, 10.0)
    for cls in (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError):
        tf_error = _tf_error(cls, "sgd/commsched_2_dense_kernel_1")
        error = commsched_error(tf_error)
        assert type(error) is CommunicationError
        assert (error.tensor, error.piece) == ("2:dense/kernel", 1)
        assert error.__cause__ is tf_error
        assert "2:dense/kernel#1" in str(error) and "restart" in str(error)


def test_a_deadline_in_a_commsched_piece_is_a_commsched_timeout_with_the_piece_pending():
    register_op("adam/commsched_0_dense_bias_0", "0:dense/bias#0", 1, 7.0)
    tf_error = _tf_error(tf.errors.DeadlineExceededError, "adam/commsched_0_dense_bias_0")
    error = commsched_error(tf_error)
    assert isinstance(error, CommschedTimeout)
    assert error.pending == ["0:dense/bias#0"] and error.timeout_s == 7.0
    assert error.__cause__ is tf_error


def test_an_eager_error_and_an_unregistered_commsched_op_are_commsched_errors_too():
    eager = tf.errors.UnavailableError(None, None, "Collective ops is aborted by: x [Op:CollectiveReduceV2] "
                                                   "name: commsched_5_w_3")
    assert isinstance(commsched_error(eager), CommunicationError)
    assert commsched_error(eager).__cause__ is eager


def test_errors_that_are_not_about_commsched_pieces_go_through():
    assert commsched_error(_tf_error(tf.errors.UnavailableError, "mwms/allreduce/CollectiveReduceV2")) is None
    assert commsched_error(_tf_error(tf.errors.InvalidArgumentError, "sgd/commsched_2_dense_kernel_1")) is None
    assert commsched_error(ValueError("x")) is None

    @function
    def bad(x):
        tf.debugging.assert_equal(x, tf.zeros_like(x), message="not zero")
        return x

    with pytest.raises(tf.errors.InvalidArgumentError):  # unchanged: not commsched's
        bad(tf.ones([2]))
    assert bad.experimental_get_tracing_count() == 1  # the tf.function's own attributes stay


def test_function_is_tf_function_with_its_arguments_and_refuses_a_double_compile():
    @function(reduce_retracing=True)
    def double(x):
        return 2 * x

    assert double(tf.constant(3.0)).numpy() == 6.0
    assert function(double) is double

    class Model:
        scale = 3.0

        @function
        def step(self, x):
            return self.scale * x

    assert Model().step(tf.constant(2.0)).numpy() == 6.0  # as a method decorator, bound to the instance
    with pytest.raises(ValueError, match="already a tf.function"):
        function(tf.function(lambda x: x), jit_compile=True)
    with pytest.raises(TypeError, match="callable"):
        function(3)


def _traced_timeout(mode: str, tmp_path: Path) -> dict:
    script = tmp_path / "traced_timeout.py"
    script.write_text(f'''
import json, sys
import tensorflow as tf
import commsched
from commsched.plugins.tensorflow import function
from commsched.plugins.tensorflow.backends import CollectiveBackend, ReplicaGroup
from commsched.plugins.tensorflow.failures import commsched_error

backend = CollectiveBackend(timeout_s=1.0)

def body(x):  # the plan check of a 2-worker group whose other worker never comes
    backend.all_gather_object({{"digest": "d"}}, ReplicaGroup(2, 0, "/device:CPU:0"))
    return x

step = function(body) if {mode!r} == "function" else tf.function(body)
try:
    step(tf.ones([1]))
    out = {{"error": None}}
except Exception as exc:
    cause = commsched_error(exc).__cause__ if commsched_error(exc) is not None else None
    out = {{"type": type(exc).__name__, "is_timeout": isinstance(exc, commsched.CommschedTimeout),
           "timeout_s": getattr(exc, "timeout_s", None), "cause": type(exc.__cause__).__name__,
           "translated_cause": type(cause).__name__}}
print("RESULT " + json.dumps(out))
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_a_timeout_while_tracing_reaches_the_caller_as_commsched_timeout_not_staging_error(tmp_path):
    compiled = _traced_timeout("function", tmp_path)
    assert compiled["is_timeout"] and compiled["type"] == "TracedTimeout", compiled
    assert compiled["timeout_s"] == 1.0 and compiled["cause"] == "DeadlineExceededError", compiled
    # a plain tf.function: AutoGraph re-creates the error, still a CommschedTimeout (not a StagingError)
    plain = _traced_timeout("plain", tmp_path)
    assert plain["is_timeout"], plain
    assert plain["translated_cause"] == "DeadlineExceededError", plain  # commsched_error() finds the original


def test_traced_timeout_keeps_what_a_commsched_timeout_has():
    error = TracedTimeout.of(CommschedTimeout("the plan check", 3.0, pending=["a#0"]))
    assert isinstance(error, CommschedError) and isinstance(error, TimeoutError)
    assert error.pending == ["a#0"] and error.timeout_s == 3.0 and "the plan check" in str(error)


class _FakeRecorder:
    def __init__(self):
        self.counters = (0, 0)

    def progress(self):
        return self.counters


class _FakePiece:
    def __init__(self, name):
        self.name = name


class _FakePlan:
    pieces = [_FakePiece("0:w#0"), _FakePiece("1:b#0")]


class _FakeRecord:
    def __init__(self, timeout_s):
        self.recorder, self.plan, self.settings = _FakeRecorder(), _FakePlan(), {"timeout_s": timeout_s, "rank": 1}


def test_the_watchdog_aborts_once_when_a_started_reduction_makes_no_progress_for_timeout_s():
    from commsched.plugins.tensorflow.watchdog import Watchdog

    record, aborted = _FakeRecord(timeout_s=5.0), []
    dog = Watchdog(lambda: [record], abort=aborted.append)
    try:
        dog._stop.set()  # drive check() by hand with a fake clock
        record.recorder.counters = (1, 0)  # a run started
        assert dog.check(now=100.0) is None
        assert dog.check(now=104.9) is None  # within timeout_s
        record.recorder.counters = (2, 1)  # progress: one finished, the next started
        assert dog.check(now=105.5) is None
        assert dog.check(now=110.4) is None  # 4.9 s since the last progress
        message = dog.check(now=110.6)
        assert message and aborted == [message]
        assert "worker 1" in message and "0:w#0" in message and "timeout_s" in message
        assert dog.check(now=200.0) is None and len(aborted) == 1  # TF's abort path runs once
    finally:
        dog.close()
    assert not dog._thread.is_alive()


def test_the_watchdog_leaves_idle_and_finished_reductions_alone():
    from commsched.plugins.tensorflow.watchdog import Watchdog

    record, aborted = _FakeRecord(timeout_s=1.0), []
    dog = Watchdog(lambda: [record], abort=aborted.append)
    try:
        dog._stop.set()
        record.recorder.counters = (3, 3)  # nothing in flight: waiting for the user's next step is fine
        for now in (0.0, 10.0, 1000.0):
            assert dog.check(now=now) is None
        assert aborted == []
    finally:
        dog.close()


def test_commsched_pieces_carry_no_tf_timeout_so_no_thread_sleeps_per_collective():
    from commsched.plugins.tensorflow.backends import CollectiveBackend, ReplicaGroup

    backend = CollectiveBackend(timeout_s=30.0)

    @tf.function
    def piece(x):
        return backend.reduce(x, group=ReplicaGroup(1, 0, "/device:CPU:0"), slot=0, keys_start=backend.reserve(1),
                              index=0, name="w#0", op="sum")

    ops = [op for op in piece.get_concrete_function(tf.ones([3])).graph.get_operations()
           if op.type == "CollectiveReduceV2"]
    assert [op.get_attr("timeout_seconds") for op in ops] == [0.0]


def test_the_watchdog_thread_stops_when_its_last_user_closes():
    from commsched.plugins.tensorflow import watchdog

    first, second = object.__new__(type("U", (), {})), object.__new__(type("V", (), {}))
    dog = watchdog.watch(lambda: [], first)
    assert watchdog.watch(lambda: [], second) is dog and dog._thread.name == "commsched-tf-watchdog"
    watchdog.release(first)
    assert dog._thread.is_alive()  # another user is still open
    watchdog.release(second)
    assert not dog._thread.is_alive()
