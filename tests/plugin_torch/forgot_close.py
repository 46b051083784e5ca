"""A training script that never calls ``opt.close()``; test_exit.py proves its interpreter exits anyway.

Usage: python forgot_close.py {torch,horovod} MARKER_DIR TIMEOUT_S
(``torch``: gloo ranks from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; ``horovod``: under horovodrun).
Writes MARKER_DIR/rank<r>.done when its main code returned, with pieces still in flight.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import commsched
from commsched.plugins.torch import DistributedOptimizer


def main() -> None:
    backend, marker_dir, timeout_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    if backend == "torch":
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    config = commsched.SchedulerConfig(partition_bytes=64, timeout_s=timeout_s)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, backend=backend, config=config)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        opt.step()  # the last step's pieces stay in flight: nothing waits for them
    (marker_dir / f"rank{opt.rank}.done").write_text("main returned without opt.close()\n")
    # no opt.close(), no destroy_process_group(), no hvd.shutdown()


if __name__ == "__main__":
    main()
