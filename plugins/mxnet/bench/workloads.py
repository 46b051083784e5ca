"""The MXNet benchmark's workload: a Gluon MLP on synthetic data with fixed seeds."""

from __future__ import annotations

from typing import Any

from commsched.bench.options import mlp_param_count

INPUTS = 256
CLASSES = 10


def describe(hidden: int, layers: int) -> dict[str, Any]:
    """The report's ``workload`` block (no MXNet import)."""
    params = mlp_param_count(INPUTS, hidden, layers, CLASSES)
    return {"name": "mlp", "description": f"MLP {INPUTS}-{layers}x{hidden}-{CLASSES}, float32",
            "param_bytes": params * 4, "num_params": params, "layers": None}


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
