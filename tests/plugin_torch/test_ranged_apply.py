"""Ranged apply: a forward that waits for a gradient of several pieces updates each range of the
parameter as its piece lands. One rank whose engine lands every piece a few milliseconds late,
so the forward always waits; the result must be bitwise equal to the plain optimizer's."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import commsched  # noqa: E402
from helpers import train_beside_reference  # noqa: E402
from commsched.errors import CommschedError  # noqa: E402
from commsched.plugins.torch import DistributedOptimizer  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]

LATE_S = 0.004


def model_of():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 6))


def late(opt, fail_at=None):
    """Land every piece ``LATE_S`` after the engine finished it (from a timer thread, as an engine's
    own thread would); the ``fail_at``-th piece fails instead."""
    start, count = opt._backend.start, [0]

    def delayed(piece, done):
        def later(exc):
            count[0] += 1
            if fail_at is not None and count[0] == fail_at:
                exc = RuntimeError("the engine lost this piece")
            threading.Timer(LATE_S, done, args=(exc,)).start()
        start(piece, later)

    opt._backend.start = delayed


def train(cls, kwargs, ranged=True, steps=4):
    model, ref = model_of(), model_of()
    config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, fusion_bytes=0, timeout_s=30)
    opt = DistributedOptimizer(cls(model.parameters(), **kwargs), model, backend="torch", config=config)
    opt._ranged = ranged
    ref_opt = cls(ref.parameters(), **kwargs)
    late(opt)
    ranges = []
    update_range = opt._update_range

    def counted(state, lo, hi):
        ranges.append((state.name, lo, hi))
        return update_range(state, lo, hi)

    opt._update_range = counted
    batches = [torch.randn(7, 48, generator=torch.Generator().manual_seed(step)) for step in range(steps)]
    return train_beside_reference(model, opt, ref, ref_opt, batches), ranges


CASES = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
         (torch.optim.SGD, dict(lr=0.1)),
         (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)), (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
         (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)), (torch.optim.Adagrad, dict(lr=0.05)),
         (torch.optim.NAdam, dict(lr=1e-2)), (torch.optim.ASGD, dict(lr=1e-2)), (torch.optim.Rprop, dict(lr=1e-2))]


@pytest.mark.parametrize("cls, kwargs", CASES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(CASES)])
@pytest.mark.parametrize("variant", ["foreach_off", "foreach_on", "fused"])
def test_ranges_applied_as_they_land_are_bitwise_equal_to_the_whole_update(cls, kwargs, variant):
    extra = {"foreach_off": {"foreach": False}, "foreach_on": {"foreach": True}, "fused": {"fused": True}}[variant]
    try:
        cls([nn.Parameter(torch.zeros(1))], **kwargs, **extra)
    except (TypeError, RuntimeError, ValueError) as exc:
        pytest.skip(f"{cls.__name__} has no {variant} implementation here: {exc}")
    equal, ranges = train(cls, {**kwargs, **extra})
    assert all(equal), f"{cls.__name__} {variant}: {equal}"
    # 0.weight is 1920 floats (8 pieces of 256): the forward waits for it from the second update on
    # (the first creates the optimizer's state, so it is applied whole, except by plain SGD).
    # Each call covers whole pieces (pieces that landed together in one call), and the calls of one
    # update cover the parameter once.
    mine = [(lo, hi) for name, lo, hi in ranges if name == "0.weight"]
    assert mine, ranges
    assert all(lo % 256 == 0 and (hi % 256 == 0 or hi == 1920) and lo < hi for lo, hi in mine), mine
    assert sum(hi - lo for lo, hi in mine) % 1920 == 0, mine


def test_off_it_applies_whole_gradients_and_stays_bitwise():
    equal, ranges = train(torch.optim.Adam, dict(lr=1e-2), ranged=False)
    assert all(equal) and ranges == []


def test_a_piece_that_fails_fails_the_wait_with_the_engines_error():
    model = model_of()
    config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, fusion_bytes=0, timeout_s=30)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, backend="torch",
                               config=config)
    late(opt, fail_at=30)  # in the second step's reductions, after the first update made the state
    x = torch.randn(7, 48, generator=torch.Generator().manual_seed(0))
    with pytest.raises(CommschedError, match="lost this piece"):
        for _ in range(4):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        opt.synchronize()
    opt.close()


def test_adjacent_ranges_are_joined_into_one_call():
    from commsched.plugins.torch.optimizer import _merged

    assert _merged([(256, 512), (0, 256), (768, 1024)]) == [(0, 512), (768, 1024)]
    assert _merged([]) == []


class Branchy(nn.Module):
    """A trunk always used and a head used on even steps only: with fusion, the trunk's gradients
    are reduced in one fused group on even steps and alone (ranged) on odd ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.trunk = nn.Linear(48, 40)
        self.head = nn.Linear(40, 6)
        self.use_head = True

    def forward(self, x):
        y = torch.tanh(self.trunk(x))
        return self.head(y) if self.use_head else y


def test_a_gradient_reduced_alone_then_fused_is_never_applied_from_the_earlier_ranges():
    model, ref = Branchy(), Branchy()
    config = commsched.SchedulerConfig(partition_bytes=1024, credit_bytes=4096, fusion_bytes=1 << 16, timeout_s=30)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model, backend="torch", config=config)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    late(opt)
    ranges = []
    update_range = opt._update_range

    def counted(state, lo, hi):
        ranges.append((state.name, lo, hi, state.future.done()))
        return update_range(state, lo, hi)

    opt._update_range = counted
    for step in range(6):
        model.use_head = ref.use_head = step % 2 == 0
        x = torch.randn(7, 48, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        if step % 2:  # the alone-reduced trunk is applied whole here, not in the next (fused) forward
            opt.synchronize()
    equal = train_beside_reference(model, opt, ref, ref_opt, [])
    assert opt.stats()["fused"], "the trunk and head were not fused: the test needs them to be"
    assert all(equal), equal
    # Every gradient reduced alone was applied whole by synchronize(); a fused one is never ranged
    # (on one rank a range applied before its reduction would still be bitwise: count them instead).
    assert ranges == [], ranges
