"""Backends that need no framework. Framework backends live in their plugins."""

from commsched.backends.inproc import ArrayOps, InProcessBackend, InProcessWorld

__all__ = ["ArrayOps", "InProcessBackend", "InProcessWorld"]
