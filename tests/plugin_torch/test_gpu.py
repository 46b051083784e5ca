"""CUDA path (NCCL, readiness by CUDA events, communication on its own stream).

Skips without a GPU; with COMMSCHED_TEST_GPU=1 a missing GPU fails instead.
One rank per GPU (NCCL refuses two ranks on one device), so with one GPU this is a
1-rank NCCL group: the stream/event path runs and must equal plain training.
"""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")


def require_gpu() -> None:
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return
    if os.environ.get("COMMSCHED_TEST_GPU") == "1":
        pytest.fail("COMMSCHED_TEST_GPU=1 but no CUDA device with NCCL is available")
    pytest.skip("no CUDA device (set COMMSCHED_TEST_GPU=1 to make this a failure)")


@pytest.mark.timeout(120)
def test_nccl_cuda_training_equals_plain_training():
    require_gpu()
    import torch.distributed as dist
    import torch.nn as nn

    import commsched
    from commsched.plugins.torch import DistributedOptimizer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
        ref = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
        ref.load_state_dict(model.state_dict())
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model,
                                   config=commsched.SchedulerConfig(partition_bytes=4096, credit_bytes=16384))
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, foreach=False)
        for step in range(5):
            x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        opt.synchronize()
        torch.cuda.synchronize()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
        opt.close()
    finally:
        dist.destroy_process_group()
