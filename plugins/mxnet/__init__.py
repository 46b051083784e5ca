"""commsched for MXNet: a KVStore that schedules ps-lite push/pull by priority, in
pieces, within a credit window, and lets the next forward start layer by layer.

``import commsched.plugins.mxnet`` registers the KVStore types ``"commsched"`` and
``"dist_commsched"`` (the name to give ``gluon.Trainer(kvstore=...)`` as a string: Gluon
drops a one-context worker's store whose name lacks "dist")::

    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {...}, kvstore="dist_commsched")
    kv = mx.kv.create("commsched")        # dist_sync underneath; settings from COMMSCHED_*
    kv = commsched.plugins.mxnet.KVStore("dist_sync", config=commsched.SchedulerConfig(...))
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {...}, kvstore=kv)

Start a job on one machine with ``commsched launch mxnet --workers 2 --servers 1 --
python train.py``. See ``commsched.plugins.mxnet.kvstore`` for the step-by-step flow, and
:func:`plan_model` for the names ``ordering="planned"`` checks a plan against.
"""

try:
    import mxnet  # noqa: F401
except ImportError as exc:  # the framework is an extra: say which one to install
    raise ImportError(f"commsched.plugins.mxnet needs MXNet, which did not import ({exc}); "
                      "install it with: pip install commsched[mxnet]") from exc

from commsched.plugins.mxnet.functions import plan_model  # noqa: E402
from commsched.plugins.mxnet.kvstore import FIRST_SUB_KEY, Commsched, Dist_Commsched, KVStore, register  # noqa: E402

register()

__all__ = ["FIRST_SUB_KEY", "Commsched", "Dist_Commsched", "KVStore", "plan_model", "register"]
