"""commsched for PyTorch: ``DistributedOptimizer`` schedules gradient all-reduces by
priority, in pieces, within a credit window, and lets the next forward start layer
by layer. See ``commsched.plugins.torch.optimizer`` for the step-by-step flow."""

from commsched.plugins.torch.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
