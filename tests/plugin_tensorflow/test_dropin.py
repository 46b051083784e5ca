"""commsched.plugins.tensorflow.DistributedGradientTape as a drop-in for
hvd.DistributedGradientTape, on a keras.applications model (Keras 3 variables)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

tf = pytest.importorskip("tensorflow")

from commsched.plugins.tensorflow import DistributedGradientTape  # noqa: E402
from helpers import REPO, horovod_or_skip, horovodrun  # noqa: E402

EXAMPLE = REPO / "examples" / "horovod_tf2_keras_app.py"


def recorded_tape():
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    return tape, loss, v


@pytest.mark.parametrize("kwargs,words", [
    (dict(compression=type("FP16Compressor", (), {})), "compression=FP16Compressor"),
    (dict(op="max"), "op='max'"),
    (dict(gradient_predivide_factor=2.0), "gradient_predivide_factor=2.0"),
    (dict(device_dense="/gpu:0"), "device_dense='/gpu:0'"),
    (dict(num_groups=3), "num_groups=3"),
])
def test_horovod_argument_it_cannot_honour_is_named(kwargs, words):
    tape, _, _ = recorded_tape()
    with pytest.raises(ValueError) as info:
        DistributedGradientTape(tape, **kwargs)
    assert words in str(info.value)


def test_auto_without_horovod_is_tf_collectives_and_horovod_defaults_are_accepted():
    tape, loss, v = recorded_tape()
    wrapped = DistributedGradientTape(tape, compression=None, op="average", sparse_as_dense=True)
    assert wrapped.commsched.backend.name == "collective" and wrapped.commsched.op == "mean"
    assert wrapped.gradient(loss, [v])[0].numpy().tolist() == [2.0, 4.0]  # one worker: the gradient itself


@pytest.mark.timeout(400)
def test_keras_applications_model_under_horovodrun_matches_hvd_allreduce(tmp_path):
    horovod_or_skip("tensorflow")
    out = tmp_path / "result.json"
    proc = subprocess.run(horovodrun(2, str(EXAMPLE), "--steps", "3", "--check", "--json", str(out)),
                          capture_output=True, text=True, timeout=380, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["backend"] == "horovod"  # backend="auto" under horovodrun
    assert result["variables"] > 100  # the whole MobileNetV2, not a toy
    # each rank trains on its own data: equal weights need the reduction, and the
    # reduced gradients equal hvd.allreduce(op=Average) of the same tape's gradients
    assert result["ranks_equal"]
    assert result["max_diff"] <= 1e-6
