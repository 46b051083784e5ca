"""commsched for PyTorch: ``DistributedOptimizer`` schedules gradient all-reduces by
priority, in pieces, within a credit window, and lets the next forward start layer
by layer. See ``commsched.plugins.torch.optimizer`` for the step-by-step flow."""

try:
    import torch  # noqa: F401
except ImportError as exc:  # the framework is an extra: say which one to install
    raise ImportError(f"commsched.plugins.torch needs PyTorch, which did not import ({exc}); "
                      "install it with: pip install commsched[torch]") from exc

from commsched.plugins.torch.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
