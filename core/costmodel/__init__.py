"""The cost model of a training step: profile, topology, collective costs, simulator.

Framework-free: plugins measure (``commsched profile``, ``commsched probe``), the
zoo describes well-known models, and everything else reads :class:`Profile` and
:class:`~commsched.costmodel.topology.Topology`.
"""

from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec

__all__ = ["LayerProfile", "Profile", "TensorSpec"]
