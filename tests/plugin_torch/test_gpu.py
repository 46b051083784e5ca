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


@pytest.mark.timeout(120)
def test_split_tied_embeddings_on_cuda_equal_plain_training():
    """split_tied_embeddings on the CUDA stream path (one NCCL rank): the projection's part reduced on the
    communication stream, the lookup's rows added before the update; allclose to plain training."""
    require_gpu()
    import torch.distributed as dist
    import torch.nn as nn

    from commsched.plugins.torch import DistributedOptimizer

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(1000, 64)
            self.mix = nn.Linear(64, 64)
            self.lm_head = nn.Linear(64, 1000, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids):
            return self.lm_head(torch.tanh(self.mix(self.wte(ids))))

    _nccl_group()
    try:
        torch.manual_seed(0)
        model, ref = TiedLM().cuda(), TiedLM().cuda()
        ref.load_state_dict(model.state_dict())
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model, split_tied_embeddings=True)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, foreach=False)
        for step in range(5):
            ids = torch.randint(0, 1000, (8, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                m(ids).logsumexp(-1).mean().backward()
                o.step()
        opt.synchronize()
        torch.cuda.synchronize()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert opt.stats()["tied_embeddings"]["wte"]["exchanges"] == 5
        opt.close()
    finally:
        dist.destroy_process_group()


def _nccl_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


@pytest.mark.timeout(120)
def test_amp_grad_scaler_on_the_synchronous_path_equals_plain_amp_on_cuda():
    require_gpu()
    import torch.distributed as dist
    import torch.nn as nn

    import commsched
    from commsched.plugins.torch import DistributedOptimizer

    _nccl_group()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
        ref = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
        ref.load_state_dict(model.state_dict())
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                   config=commsched.SchedulerConfig(cross_iteration=False, partition_bytes=4096))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        scalers = [torch.amp.GradScaler("cuda", init_scale=1024.0) for _ in range(2)]
        for step in range(4):
            x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            for m, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
                o.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = m(x).float().square().mean()
                if step == 2:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                scaler.step(o)
                scaler.update()
        opt.synchronize()
        torch.cuda.synchronize()
        assert scalers[0].get_scale() == scalers[1].get_scale() == 512.0
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
        opt.close()
        cross = DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1), ref)
        scaler = torch.amp.GradScaler("cuda")
        scaler.scale(ref(x).square().mean()).backward()
        with pytest.raises(ValueError, match="cross_iteration=False"):
            scaler.step(cross)
        cross.close()
    finally:
        dist.destroy_process_group()


def _gloo_cuda_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.nn as nn

    import commsched
    from commsched.plugins.torch import DistributedOptimizer

    torch.cuda.set_device(0)  # two processes on one GPU: gloo allows it, NCCL does not
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
        ref = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).cuda()
        ref.load_state_dict(model.state_dict())
        opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model,
                                   config=commsched.SchedulerConfig(partition_bytes=4096, credit_bytes=16384))
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3, foreach=False)
        for step in range(5):
            xs = [torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(10 * step + r))
                  for r in range(2)]
            opt.zero_grad()
            model(xs[rank]).square().mean().backward()
            opt.step()
            ref_opt.zero_grad()  # the reference: the mean of both ranks' gradients, computed locally
            (sum(ref(x).square().mean() for x in xs) / 2).backward()
            ref_opt.step()
        opt.synchronize()
        torch.cuda.synchronize()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        stats = opt.stats()
        assert stats["steps"] == 5 and len(stats["bubble_s"]) == 5
        opt.close()
        with open(f"{out}.{rank}", "w") as f:
            f.write("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_processes_on_one_gpu_over_gloo_equal_the_averaged_reference(tmp_path):
    require_gpu()
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank")
    # Each rank is this file run as a script (pytest's importlib mode makes spawn's pickling unreliable).
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), out]) for rank in range(2)]
    try:
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], f"rank exit codes {codes}"
    assert all(os.path.exists(f"{out}.{r}") for r in range(2))


if __name__ == "__main__":
    import sys

    _gloo_cuda_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
