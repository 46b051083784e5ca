"""The MXNet benchmark's workload: a Gluon MLP on synthetic data with fixed seeds."""

from __future__ import annotations

from typing import Any

from commsched.bench.options import CLASSES, INPUTS, mlp_workload

__all__ = ["CLASSES", "INPUTS", "build_model", "describe"]

#: The report's ``workload`` block (no framework import).
describe = mlp_workload


def build_model(hidden: int, layers: int) -> Any:
    """The Gluon model, seeded, initialised and run once (so its parameters exist)."""
    import mxnet as mx
    from mxnet import gluon

    mx.random.seed(0)
    net = gluon.nn.Sequential()
    for _ in range(layers):
        net.add(gluon.nn.Dense(hidden, activation="relu"))
    net.add(gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, INPUTS)))
    return net
