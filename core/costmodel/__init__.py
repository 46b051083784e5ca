"""The cost model of a training step: profile, topology, collective costs, simulator.

Framework-free: plugins measure (``commsched profile``, ``commsched probe``), the
zoo describes well-known models, and everything else reads :class:`Profile` and
:class:`Topology`. Used three ways: predict (``commsched simulate``/``advise``),
plan (the topology-aware planner) and tune (the auto-tuner).
"""

from commsched.costmodel.collectives import (ALGORITHMS, Phase, all_gather_s, allreduce_phases, allreduce_s,
                                             best_algorithm, nic_bytes, reduce_scatter_s, ring_allreduce_s)
from commsched.costmodel.profile import LayerProfile, Profile, TensorSpec
from commsched.costmodel.simulator import SimResult, SimSettings, simulate
from commsched.costmodel.topology import Link, Topology, parse_bandwidth
from commsched.costmodel.zoo import list_devices, list_models, zoo_profile

__all__ = ["ALGORITHMS", "LayerProfile", "Link", "Phase", "Profile", "SimResult", "SimSettings", "TensorSpec",
           "Topology", "all_gather_s", "allreduce_phases", "allreduce_s", "best_algorithm", "list_devices",
           "list_models", "nic_bytes", "parse_bandwidth", "reduce_scatter_s", "ring_allreduce_s", "simulate",
           "zoo_profile"]
