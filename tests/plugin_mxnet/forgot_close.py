"""A script that never closes its commsched KVStore; test_exit.py proves its interpreter exits anyway.

Usage: python forgot_close.py MARKER_DIR TIMEOUT_S. Writes MARKER_DIR/rank0.done when its main code
returned, with a pushpull still scheduled (the engine may not have run it yet).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mxnet as mx

import commsched
from commsched.plugins.mxnet import KVStore


def main() -> None:
    marker_dir, timeout_s = Path(sys.argv[1]), float(sys.argv[2])
    kv = KVStore("local", commsched.SchedulerConfig(partition_bytes=64, timeout_s=timeout_s))
    kv.init(0, mx.nd.zeros((64,)))
    for step in range(3):
        grad = mx.nd.ones((64,)) * step
        kv.pushpull(0, grad)
    (marker_dir / "rank0.done").write_text("main returned without kv.close()\n")
    # no kv.close(): commsched's threads and the engine's queued work must still let the process exit


if __name__ == "__main__":
    main()
