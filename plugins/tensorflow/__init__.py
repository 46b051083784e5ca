"""commsched for TensorFlow: scheduled gradient all-reduce under ``tf.distribute``.

* :func:`DistributedOptimizer` wraps a Keras optimizer (Keras 3 in custom loops,
  tf-keras in custom loops and ``model.fit``);
* :func:`DistributedGradientTape` wraps a ``tf.GradientTape`` for custom loops and
  returns gradients already averaged across workers;
* :func:`function` is ``tf.function`` whose failed commsched pieces (a worker died or
  hangs) raise commsched's errors instead of TensorFlow's;
* :func:`unroll` runs several steps in one such function so that the next
  forward overlaps the previous step's communication;
* :func:`report` (and ``opt.report()``, ``tape.report()``) summarises what the graph
  measured of the pieces: bytes, time in flight, exposed communication, bandwidth;
* :func:`plan_model` lists the variables as ``ordering="planned"`` names them.

Pieces are reduced with TF collective ops (``backend="collective"``, the default outside horovodrun) or
Horovod (``backend="horovod"``), in an order that :mod:`commsched.replay` fixes in
the graph, identically on every worker. See ``docs/tensorflow.md``.
"""

try:
    import tensorflow  # noqa: F401
except ImportError as exc:  # the framework is an extra: say which one to install
    raise ImportError(f"commsched.plugins.tensorflow needs TensorFlow, which did not import ({exc}); "
                      "install it with: pip install commsched[tensorflow]") from exc

from commsched.plugins.tensorflow.functions import function, plan_model, report, unroll
from commsched.plugins.tensorflow.optimizer import DistributedOptimizer
from commsched.plugins.tensorflow.tape import DistributedGradientTape

__all__ = ["DistributedGradientTape", "DistributedOptimizer", "function", "plan_model", "report", "unroll"]
