"""Single-process checks of the torch plugin's API and its errors (a 1-rank gloo group)."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import commsched  # noqa: E402
from commsched.errors import HorovodUnavailable, SchedulerClosed  # noqa: E402
from commsched.plugins.torch import DistributedOptimizer  # noqa: E402
from commsched.plugins.torch.backends import TorchBackend  # noqa: E402
from helpers import commsched_threads, init_one_rank_group  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_rank_group")


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train(opt, model, steps=3):
    for i in range(steps):
        opt.zero_grad()
        model(torch.full((3, 4), float(i))).sum().backward()
        opt.step()


def test_updates_land_in_the_next_forward_and_match_plain_sgd():
    model, ref = small(), small()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                               config=commsched.SchedulerConfig(partition_bytes=16, credit_bytes=32))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    train(opt, model)
    train(ref_opt, ref)
    opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(p.grad is None for p in model.parameters())  # the scheduler consumed the gradients
    opt.close()


def test_close_leaves_no_thread_and_refuses_more_steps():
    model = small()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters()), model)
    train(opt, model, 2)
    opt.close()
    opt.close()  # idempotent
    assert not commsched_threads()
    for use in (opt.step, opt.synchronize, lambda: opt.load_state_dict(opt.state_dict())):
        with pytest.raises(SchedulerClosed, match="closed"):
            use()


def test_the_context_manager_closes_and_the_scheduler_closes_the_backend_once():
    model = small()
    closes = []
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model) as opt:
        close = opt._backend.close
        opt._backend.close = lambda: (closes.append(1), close())
        train(opt, model, 2)
    assert closes == [1]  # by the scheduler; the optimizer no longer closes it too
    assert not commsched_threads()
    with pytest.raises(SchedulerClosed):
        opt.step()


def test_torch_backend_close_is_idempotent_and_a_closed_backend_refuses_broadcasts():
    backend = TorchBackend()
    tensor = torch.ones(2)
    backend.broadcast(tensor, 0)
    assert backend.broadcast_object({"a": 1}, 0) == {"a": 1}
    backend.close()
    backend.close()
    with pytest.raises(commsched.CommschedError, match="closed"):
        backend.broadcast(tensor, 0)


def test_a_missing_horovod_raises_horovod_unavailable_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import fails as if not installed
    model = small()
    with pytest.raises(HorovodUnavailable, match="make horovod") as info:
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, backend="horovod")
    assert isinstance(info.value, ImportError)
    assert not commsched_threads()


def test_lbfgs_is_refused_with_the_reason():
    model = small()
    with pytest.raises(ValueError, match="closure"):
        DistributedOptimizer(torch.optim.LBFGS(model.parameters()), model)


def test_step_with_closure_needs_the_synchronous_path():
    model = small()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="cross_iteration=False"):
        opt.step(lambda: 0.0)
    opt.close()
    sync = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                config=commsched.SchedulerConfig(cross_iteration=False))
    model(torch.ones(1, 4)).sum().backward()
    sync.synchronize()
    assert all(p.grad is not None for p in model.parameters())  # the synchronous path keeps p.grad: clip here
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert sync.step(lambda: 1.5) == 1.5
    sync.close()


def test_sparse_gradient_gets_a_clear_error_naming_the_parameter():
    model = nn.Embedding(10, 3, sparse=True)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="'weight'.*sparse"):
        model(torch.tensor([1, 2])).sum().backward()
    opt.close()


class _TiedLM(nn.Module):
    """An embedding whose weight the head registers too (lm_head.weight = wte.weight)."""

    def __init__(self, **embedding):
        super().__init__()
        self.wte = nn.Embedding(12, 4, **embedding)
        self.lm_head = nn.Linear(4, 12, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        h = self.wte(ids)
        h.mul_(1.5)  # in place on the lookup's output, as some models scale it
        return self.lm_head(h)


def test_split_tied_embeddings_finds_the_tie_and_refuses_what_it_cannot_split():
    from commsched.plugins.torch.tied import find_tied_embeddings

    model = _TiedLM()
    assert [name for name, _ in find_tied_embeddings(model)] == ["wte"]
    untied = nn.Sequential(nn.Embedding(12, 4), nn.Linear(4, 12))
    assert find_tied_embeddings(untied) == []
    with pytest.raises(ValueError, match="'wte' uses max_norm"):
        find_tied_embeddings(_TiedLM(max_norm=1.0))
    with pytest.raises(ValueError, match="no nn.Embedding whose weight another module"):
        DistributedOptimizer(torch.optim.SGD(untied.parameters(), lr=0.1), untied, split_tied_embeddings=True)
    with pytest.raises(ValueError, match="needs the model"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), split_tied_embeddings=True)
    with pytest.raises(TypeError, match="True or False"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, split_tied_embeddings="yes")


def test_split_tied_embeddings_trains_as_plain_sgd_on_one_rank_and_close_gives_the_forward_back():
    """One rank: the projection's part plus the lookup's rows is the whole gradient (allclose to plain SGD);
    the module's state_dict keys stay, and close() ends the exchange thread and restores the forward."""
    model, ref = _TiedLM(), _TiedLM()
    ref.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, split_tied_embeddings=True)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        ids = torch.tensor([[1, 2, 2, 5], [5, 7, 1, step]])
        opt.zero_grad()
        model(ids).logsumexp(-1).mean().backward()
        opt.step()
        plain.zero_grad()
        ref(ids).logsumexp(-1).mean().backward()
        plain.step()
    opt.synchronize()
    assert torch.allclose(model.wte.weight, ref.wte.weight, atol=1e-6)
    assert list(model.state_dict()) == keys and opt.stats()["tied_embeddings"]["wte"]["exchanges"] == 4
    # the recorded profile names the tie and says its readiness is the split's (advise does not offer it again)
    prof = opt.profile()
    assert prof.tied == ("wte.weight",) and prof.meta["tied_split"] == ["wte.weight"]
    opt.close()
    assert "forward" not in model.wte.__dict__ and not commsched_threads()


def test_optimizer_over_other_parameters_is_refused():
    model, other = small(), small()
    with pytest.raises(ValueError, match="not in model.named_parameters"):
        DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DistributedOptimizer(model, model)


@pytest.mark.parametrize("cross_iteration", [True, False])
def test_non_contiguous_gradient_is_reduced_and_applied(cross_iteration):
    # A parameter stored transposed (as channels_last weights are): autograd gives its grad the
    # parameter's strides, so the gradient the optimizer's hook sees is not contiguous and is
    # reduced through a contiguous copy (then copied back on the synchronous path).
    w = nn.Parameter(torch.arange(24, dtype=torch.float32).reshape(6, 4).t())
    assert not w.is_contiguous()
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.is_contiguous()))  # runs before commsched's
    model = nn.Module()
    model.w = w
    model.forward = lambda x: x @ model.w
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model,
                               config=commsched.SchedulerConfig(partition_bytes=8, cross_iteration=cross_iteration))
    try:
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
        model(x).sum().backward()
        assert seen == [False], "the gradient reached the optimizer contiguous; the test proves nothing"
        expected = w.detach().clone() - x.sum(0, keepdim=True).t().expand(4, 6)  # d/dw sum(x @ w) = x^T 1
        opt.step()
        opt.synchronize()
        assert torch.equal(model.w.detach(), expected)
        assert opt.stats()["pieces"] == 24 * 4 // 8  # cut into 8-byte pieces of the contiguous copy
    finally:
        opt.close()


def test_state_dict_has_the_wrapped_optimizers_format_and_round_trips():
    model = small()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    train(opt, model, 2)
    state = opt.state_dict()
    plain = torch.optim.Adam(small().parameters(), lr=0.01)
    plain.load_state_dict(state)  # the plain optimizer accepts it
    assert int(state["state"][0]["step"]) == 2
    opt.load_state_dict(state)
    train(opt, model, 1)
    assert int(opt.state_dict()["state"][0]["step"]) == 3
    opt.close()


def test_stats_report_bubble_pieces_and_priorities_in_forward_order():
    model = small()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               config=commsched.SchedulerConfig(partition_bytes=16))
    train(opt, model, 3)
    opt.synchronize()
    stats = opt.stats()
    assert stats["steps"] == 3 and len(stats["bubble_s"]) == 3
    assert list(stats["priorities"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert stats["pieces"] == 3 * sum(-(-p.numel() * 4 // 16) for p in model.parameters())
    opt.close()


def test_destroyed_process_group_gives_a_clear_error_not_a_hang():
    model = small()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    train(opt, model, 1)
    opt.synchronize()
    dist.destroy_process_group()
    try:
        with pytest.raises(commsched.CommschedError, match="destroy"):
            model(torch.ones(1, 4)).sum().backward()  # the first failed piece fails the later submits
            opt.synchronize(timeout=10)
        opt.close()
    finally:
        init_one_rank_group()


def test_horovod_backend_defaults_to_1mib_pieces_unless_the_environment_says_otherwise(monkeypatch):
    from commsched.plugins.torch.optimizer import HOROVOD_PARTITION_BYTES, _default_config

    monkeypatch.delenv("COMMSCHED_PARTITION_BYTES", raising=False)
    assert _default_config("horovod").partition_bytes == HOROVOD_PARTITION_BYTES == 1 << 20
    assert _default_config("torch").partition_bytes == commsched.SchedulerConfig().partition_bytes
    monkeypatch.setenv("COMMSCHED_PARTITION_BYTES", "2MiB")
    assert _default_config("horovod").partition_bytes == 2 << 20


def test_report_summarises_the_run_and_compares_with_the_cost_model():
    from commsched.costmodel.topology import Topology

    model = small()
    with DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                              config=commsched.SchedulerConfig(partition_bytes=256, credit_bytes=1024)) as opt:
        train(opt, model, steps=4)
        opt.synchronize()
        plain = opt.report()
        with_model = opt.report(topology=Topology.emulated(2, None, "1gbit"))
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert "after 4 steps" in plain and "partition_bytes=256" in plain and "pass topology=" in plain
    assert f"{nbytes / 1e6:.2f} MB" in plain  # every gradient byte, once per step
    assert "the network should take" in with_model and "the simulator expected a step of" in with_model
