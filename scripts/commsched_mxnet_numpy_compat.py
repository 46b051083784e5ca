"""Environment shim for mxnet 1.9.1 on numpy >= 1.24 (installed by scripts/setup_venv.sh).

mxnet 1.9.1 still uses the alias ``numpy.bool``, which numpy 1.24 removed, so
``import mxnet`` fails on numpy 1.26 (the oldest numpy TensorFlow 2.21 accepts).
This module is imported from ``commsched_mxnet_numpy_compat.pth`` at interpreter
start. It does NOT import numpy there (that would slow every Python start in
the venv, pip included): it puts a finder on ``sys.meta_path`` that, the first
time ``mxnet`` is imported, sets ``numpy.bool = numpy.bool_`` if it is missing
and otherwise does nothing. It never finds a module itself.

This lives in the environment, not in commsched: library code must not patch
other libraries.
"""
import sys


class _MxnetNumpyBoolAlias:
    done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mxnet" and not self.done:
            self.done = True  # set first: importing numpy re-enters this finder
            try:
                import numpy
            except ImportError:
                return None
            if "bool" not in numpy.__dict__:
                numpy.bool = numpy.bool_
        return None  # never finds anything itself

    def invalidate_caches(self):
        pass


if not any(type(f).__name__ == "_MxnetNumpyBoolAlias" for f in sys.meta_path):
    sys.meta_path.insert(0, _MxnetNumpyBoolAlias())
