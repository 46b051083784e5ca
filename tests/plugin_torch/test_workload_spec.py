"""resolve_workload: built-in names and module:function workloads for commsched bench/profile/simulate."""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")

from commsched.plugins.torch.bench.workloads import DEFAULT_BATCH_SIZE, WORKLOADS, resolve_workload  # noqa: E402

USER_MODULE = """
import torch
from torch import nn
import torch.nn.functional as F

def net():
    return nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))

def batch(n, gen):
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)

def three():
    return net(), batch, F.cross_entropy

def four():
    return net(), batch, F.cross_entropy, 5

def two():
    return net(), batch

def not_a_model():
    return "net", batch, F.cross_entropy

def bad_batch_size():
    return net(), batch, F.cross_entropy, 0
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_workloads.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_workloads"


def test_builtin_names_resolve_to_the_builtin_workload():
    assert resolve_workload("tiny") is WORKLOADS["tiny"]


@pytest.mark.parametrize("fn,batch_size", [("three", DEFAULT_BATCH_SIZE), ("four", 5)])
def test_module_function_builds_a_fresh_model_that_trains_on_its_batches(user_module, fn, batch_size):
    w = resolve_workload(f"{user_module}:{fn}")
    assert w.name == f"{user_module}:{fn}" and w.batch_size == batch_size
    a, b = w.build(), w.build()
    assert a is not b and isinstance(a, torch.nn.Module)
    x, y = w.make_batch(w.batch_size, torch.Generator().manual_seed(0))
    loss = w.loss(a(x), y)
    loss.backward()
    assert loss.ndim == 0 and all(p.grad is not None for p in a.parameters())


@pytest.mark.parametrize("spec,words", [
    ("nonsense", "module:function"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("{m}:missing", "has no function 'missing'"),
    ("{m}:two", "returned tuple of 2 items"),
    ("{m}:not_a_model", "must be a torch.nn.Module"),
    ("{m}:bad_batch_size", "batch size must be an int >= 1"),
    (":f", "expected module:function"),
])
def test_bad_spec_says_what_is_wrong(user_module, spec, words):
    with pytest.raises(ValueError) as info:
        resolve_workload(spec.format(m=user_module))
    assert words in str(info.value)
