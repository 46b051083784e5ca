"""commsched.plugins.torch.DistributedOptimizer as a drop-in for hvd.DistributedOptimizer,
and the constructor's bad-input errors (each before any thread, group or hook exists)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import commsched  # noqa: E402
import commsched.plugins.torch.optimizer as optimizer_module  # noqa: E402
from commsched.plugins.torch import DistributedOptimizer  # noqa: E402
from commsched.plugins.torch.backends import TorchBackend  # noqa: E402
from helpers import REPO, commsched_threads, horovod_or_skip, horovodrun  # noqa: E402

EXAMPLE = REPO / "examples" / "horovod_synthetic_benchmark.py"


pytestmark = pytest.mark.usefixtures("one_rank_group")


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def no_hooks(model):
    return all(not m._forward_pre_hooks for m in model.modules()) and \
        all(not p._post_accumulate_grad_hooks for p in model.parameters())


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs,error,words", [
    (dict(config={"partition_bytes": 1024}), TypeError, "SchedulerConfig(**{'partition_bytes': 1024})"),
    (dict(backward_passes_per_step=True), TypeError, "backward_passes_per_step=True"),
    (dict(backward_passes_per_step=0), ValueError, "backward_passes_per_step=0"),
    (dict(backend="horovod", process_group=object()), ValueError, "process_group"),
    (dict(backend="nccl"), ValueError, "backend='nccl'"),
    (dict(op="max"), ValueError, "op='max'"),
    (dict(op="sum", gradient_predivide_factor=2.0), ValueError, "gradient_predivide_factor"),
    (dict(gradient_predivide_factor=0), ValueError, "gradient_predivide_factor=0"),
    (dict(compression=type("FP16Compressor", (), {})), ValueError, "compression=FP16Compressor"),
    (dict(num_groups=2), ValueError, "num_groups"),
    (dict(sparse_as_dense=True), ValueError, "sparse_as_dense"),
    (dict(named_parameters=[1, 2]), TypeError, "named_parameters should be a sequence of tuples"),
])
def test_bad_argument_is_named_before_any_thread_starts(kwargs, error, words):
    model = small()
    before = commsched_threads()
    with pytest.raises(error) as info:
        DistributedOptimizer(sgd(model), model, **kwargs)
    assert words in str(info.value)
    assert commsched_threads() == before
    assert no_hooks(model)


def test_failed_constructor_broadcast_leaves_no_hook_or_thread(monkeypatch):
    # A 2-rank world whose broadcast fails (a peer died during start-up): the
    # scheduler's threads already run, and must be gone when the error arrives.
    def failing_backend(name, group, timeout_s):
        backend = TorchBackend(group)
        backend.world_size = 2

        def broadcast(tensor, root):
            raise RuntimeError("peer went away during the initial broadcast")
        backend.broadcast = broadcast
        return backend

    monkeypatch.setattr(optimizer_module, "make_backend", failing_backend)
    model = small()
    before = commsched_threads()
    with pytest.raises(RuntimeError, match="initial broadcast"):
        DistributedOptimizer(sgd(model), model, config=commsched.SchedulerConfig(ordering="fifo"))
    assert commsched_threads() == before
    assert no_hooks(model)


# ------------------------------------------------------------ Horovod's shape
def test_without_model_warns_once_how_to_pass_it_and_steps_synchronously():
    model = small()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 1 and "model=" in said[0]
    with opt:
        assert opt.config.cross_iteration is False and opt.backend == "torch"
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()  # synchronous: the update has landed when step() returns
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert sorted(opt.stats()["priorities"]) == sorted(n for n, _ in model.named_parameters())


def test_named_parameters_as_second_positional_argument_like_horovod():
    model = small()
    with pytest.warns(UserWarning, match="model="):
        opt = DistributedOptimizer(sgd(model), model.named_parameters())
    with opt:
        assert opt.model is None
        assert list(opt.stats()["priorities"]) == [n for n, _ in model.named_parameters()]


def test_horovod_op_sum_skips_the_division(monkeypatch):
    model = small()
    seen = []
    opt = DistributedOptimizer(sgd(model), model, op="sum", config=commsched.SchedulerConfig(cross_iteration=False))
    monkeypatch.setattr(opt, "world_size", 4)  # an average would divide by 4
    with opt:
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        seen = [p.grad.clone() for p in model.parameters()]
        opt.synchronize()
        assert all(torch.equal(g, p.grad) for g, p in zip(seen, model.parameters(), strict=True))


def test_step_without_backward_creates_state_and_is_not_a_training_step():
    # What hvd.broadcast_optimizer_state does on a fresh optimizer: zero gradients,
    # step() with no backward. The state must exist afterwards, and the first real
    # forward must still learn the order of use (priorities follow the forward).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = DistributedOptimizer(sgd(model), model)
    with opt:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        assert {k for s in opt.state_dict()["state"].values() for k in s} == {"momentum_buffer"}
        assert opt.stats()["steps"] == 0
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
        opt.synchronize()
        assert opt.stats()["steps"] == 3
    ref_model = small()
    reference = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for p in ref_model.parameters():
        p.grad = torch.zeros_like(p)
    reference.step()
    for _ in range(3):
        reference.zero_grad()
        ref_model(torch.ones(3, 4)).sum().backward()
        reference.step()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -------------------------------------------------------- under horovodrun
def run_synthetic(tmp_path, dist_name):
    out, params = tmp_path / f"{dist_name}.json", tmp_path / f"{dist_name}.pt"
    cmd = horovodrun(2, str(EXAMPLE), "--dist", dist_name, "--num-iters", "2", "--num-batches-per-iter", "3",
                     "--json", str(out), "--save", str(params))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), torch.load(params)


@pytest.mark.timeout(600)
def test_horovod_synthetic_benchmark_one_line_change_matches_hvd(tmp_path):
    horovod_or_skip("torch")
    hvd_result, hvd_params = run_synthetic(tmp_path, "hvd")
    lines = []
    for name in ("commsched", "commsched-model"):
        result, params = run_synthetic(tmp_path, name)
        assert result["backend"] == "horovod"  # backend="auto" under horovodrun
        assert result["ranks_equal"]
        # 3 warm-up + 2 x 3 timed steps; hvd.broadcast_optimizer_state's step is not one
        assert result["steps_counted"] == 9
        assert result["state_keys"] == hvd_result["state_keys"] == ["momentum_buffer"]
        if name == "commsched":  # no model=: whole tensors (the 8 MiB one uncut), at most one piece per parameter
            assert result["pieces"] <= 8 * result["steps_counted"], result["pieces"]
        torch.testing.assert_close(params, hvd_params, rtol=1e-6, atol=1e-7)
        lines.append({"dist": name, "img_sec_per_worker": round(result["img_sec_per_worker"], 1),
                      "vs_hvd": round(result["img_sec_per_worker"] / hvd_result["img_sec_per_worker"], 3)})
    # A figure to read, not a timed assertion (2 shared cores).
    print(json.dumps({"benchmark": "horovod-synthetic", "hvd_img_sec_per_worker":
                      round(hvd_result["img_sec_per_worker"], 1), "commsched": lines}), file=sys.stderr)


def test_model_state_dict_holds_every_ended_step_and_load_does_not_apply_it_again():
    # torchrun + DDP scripts save model.state_dict() on rank 0 after step() and load it on every
    # rank (docs/quickstart.md): the checkpoint must hold the last step's update, which the
    # cross-iteration overlap leaves for the next forward, and a load must not leave that update
    # pending to be applied on top of the loaded parameters.
    model, reference = small(), small()
    ref_opt = sgd(reference)
    opt = DistributedOptimizer(sgd(model), model)
    with opt:
        for _ in range(2):
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                m(torch.ones(3, 4)).sum().backward()
                o.step()
        saved = model.state_dict()  # step 2's update was pending until here
        assert all(torch.equal(saved[k], v) for k, v in reference.state_dict().items())
        # a backward whose step() has not run yet stays pending, as DDP's parameters are not updated yet
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
        opt.step()
        model.load_state_dict(saved)  # the pending update of step 3 lands first, then the load overwrites it
        with torch.no_grad():
            model(torch.ones(3, 4))  # nothing left to apply
        assert all(torch.equal(p, saved[k]) for k, p in model.state_dict().items())


def test_horovod_without_cross_iteration_defaults_to_whole_tensors(monkeypatch):
    # step() waits for every gradient there, so pieces only add Horovod negotiations (docs/horovod.md)
    monkeypatch.delenv("COMMSCHED_PARTITION_BYTES", raising=False)
    sync = optimizer_module._default_config("horovod", cross_iteration=False)
    assert sync.partition_bytes == optimizer_module.HOROVOD_SYNC_PARTITION_BYTES == 64 << 20
    assert optimizer_module._default_config("horovod").partition_bytes == optimizer_module.HOROVOD_PARTITION_BYTES
    assert optimizer_module._default_config("torch", cross_iteration=False).partition_bytes == \
        commsched.SchedulerConfig().partition_bytes
    monkeypatch.setenv("COMMSCHED_PARTITION_BYTES", "2MiB")  # the environment still wins
    assert optimizer_module._default_config("horovod", cross_iteration=False).partition_bytes == 2 << 20
