"""A TensorFlow training script that never calls ``close()``; test_exit.py proves its interpreter exits anyway.

Usage: python forgot_close.py {collective,horovod} MARKER_DIR TIMEOUT_S
(``collective``: a TF_CONFIG worker of MultiWorkerMirroredStrategy; ``horovod``: under horovodrun).
Writes MARKER_DIR/rank<r>.done when its main code returned.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import tensorflow as tf

import commsched
from commsched.plugins.tensorflow import DistributedGradientTape


def main() -> None:
    backend, marker_dir, timeout_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    config = commsched.SchedulerConfig(partition_bytes=64, credit_bytes=128, timeout_s=timeout_s)
    if backend == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        rank, strategy = hvd.rank(), tf.distribute.get_strategy()
    else:
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        v = tf.Variable(tf.ones([40]))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v)
        grads = DistributedGradientTape(tape, config=config, backend=backend).gradient(loss, [v])
        v.assign_sub(0.1 * grads[0])

    for _ in range(2):
        strategy.run(step)
    (marker_dir / f"rank{rank}.done").write_text("main returned without close()\n")


if __name__ == "__main__":
    main()
