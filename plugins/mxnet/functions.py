"""Public helpers of the MXNet plugin: ``plan_model`` (the model as ``ordering="planned"`` names it).

The commsched KVStore knows tensors by their KVStore key, so a plan names each one
``str(key)``. ``gluon.Trainer`` keys a parameter by its index in the parameters it was
given (``0..N-1``: a list in its order, a dict or ``ParameterDict`` by sorted name);
:func:`plan_model` lists them so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from commsched.plan import PlannedTensor

__all__ = ["plan_model"]


def plan_model(params: Any) -> list[PlannedTensor]:
    """The plan's model entries for the parameters a ``gluon.Trainer`` is given (the same
    ``ParameterDict``/dict or list; indexed as the Trainer does): ``str(index)``, element count,
    element size, shape and dtype name. Parameters must be initialized. A parameter with
    ``grad_req='null'`` is refused: the Trainer never communicates it, but the KVStore
    holds its key, so give the Trainer (and this) only the trained parameters.
    """
    # the Trainer's own order: a dict's parameters by sorted name, a list as it is
    values = [params[k] for k in sorted(params.keys())] if hasattr(params, "keys") else list(params)
    out = []
    for i, p in enumerate(values):
        if getattr(p, "grad_req", "write") == "null":
            raise ValueError(f"parameter {p.name!r} has grad_req='null'; pass only trained parameters to the Trainer "
                             "and to plan_model, e.g. {k: v for k, v in params.items() if v.grad_req != 'null'}")
        data = p.data()
        dtype = np.dtype(data.dtype)
        out.append(PlannedTensor(str(i), int(data.size), int(dtype.itemsize), tuple(int(d) for d in data.shape),
                                 dtype.name))
    return out
