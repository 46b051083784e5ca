"""Framework plugins: ``commsched.plugins.torch``, ``.tensorflow``, ``.mxnet``."""
