"""Lean apply: a module's parameters (of one param group) are updated by one call of the user's
optimizer class, where that is bitwise equal to one call over all parameters (the reference).
One rank; the 2-rank equivalence suite runs the same path with communication."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import commsched  # noqa: E402
from helpers import train_beside_reference  # noqa: E402
from commsched.plugins.torch import DistributedOptimizer  # noqa: E402
from commsched.plugins.torch.optimizer import LEAN_APPLY  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


def model_of():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


class CoupledSGD(torch.optim.SGD):
    """A subclass: it might couple parameters, so commsched keeps one call per parameter."""


def train(cls, kwargs, lean=True, fusion=0, steps=4):
    model, ref = model_of(), model_of()
    opt = DistributedOptimizer(cls(model.parameters(), **kwargs), model, backend="torch",
                               config=commsched.SchedulerConfig(fusion_bytes=fusion, timeout_s=30))
    opt._lean = lean
    ref_opt = cls(ref.parameters(), **kwargs)
    calls = []  # the number of parameters of each call of the optimizer class, in order
    update = opt._update

    def counted(batch):
        calls.append(len(batch))
        update(batch)

    opt._update = counted
    batches = [torch.randn(5, 6, generator=torch.Generator().manual_seed(step)) for step in range(steps)]
    # every reduction done (none applied) before the forward: no race
    return train_beside_reference(model, opt, ref, ref_opt, batches, opt._scheduler.synchronize), calls


CASES = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
         (torch.optim.Adam, dict(lr=1e-2)), (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
         (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5)), (torch.optim.Adagrad, dict(lr=0.05)),
         (torch.optim.Adamax, dict(lr=1e-2)), (torch.optim.NAdam, dict(lr=1e-2)), (torch.optim.RAdam, dict(lr=1e-2)),
         (torch.optim.Adadelta, dict()), (torch.optim.ASGD, dict(lr=1e-2)), (torch.optim.Rprop, dict(lr=1e-2))]


@pytest.mark.parametrize("cls, kwargs", CASES, ids=[c.__name__ for c, _ in CASES])
@pytest.mark.parametrize("variant", ["foreach_off", "foreach_on", "fused"])
def test_one_call_per_module_is_bitwise_equal_to_the_reference(cls, kwargs, variant):
    extra = {"foreach_off": {"foreach": False}, "foreach_on": {"foreach": True}, "fused": {"fused": True}}[variant]
    try:
        cls([nn.Parameter(torch.zeros(1))], **kwargs, **extra)
    except (TypeError, RuntimeError, ValueError) as exc:
        pytest.skip(f"{cls.__name__} has no {variant} implementation here: {exc}")
    equal, calls = train(cls, {**kwargs, **extra})
    assert all(equal), f"{cls.__name__} {variant}: {equal}"
    # One rank: every reduction is done when the next forward starts, so its first pre-hook applies
    # all six parameters in one call (the sweep), as synchronize() does after the last step.
    assert calls == [6] * 4, calls


def test_every_lean_class_is_covered_here():
    assert {c for c, _ in CASES} == set(LEAN_APPLY)


def test_a_subclass_and_lean_off_keep_one_call_per_parameter_and_stay_bitwise():
    equal, calls = train(CoupledSGD, dict(lr=0.1, momentum=0.9))
    assert all(equal) and calls == [1] * 24, calls
    equal, calls = train(torch.optim.Adam, dict(lr=1e-2), lean=False)
    assert all(equal) and calls == [1] * 24, calls


def test_lean_apply_with_fused_gradients_is_bitwise():
    equal, calls = train(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), fusion=1 << 16)
    assert all(equal) and calls == [6] * 4, calls
