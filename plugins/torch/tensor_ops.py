"""Zero-copy tensor operations the core needs, for torch tensors."""

from __future__ import annotations

import torch

__all__ = ["TorchOps", "check_gradient"]


class TorchOps:
    """:class:`commsched.partition.TensorOps` for contiguous torch tensors: pieces are
    ``tensor.view(-1)[start:stop]``, views of the same storage."""

    def numel(self, tensor: torch.Tensor) -> int:
        return tensor.numel()

    def element_size(self, tensor: torch.Tensor) -> int:
        return tensor.element_size()

    def flat_view(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return tensor.view(-1)[start:stop]


_SUPPORTED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_gradient(name: str, grad: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the parameter for gradients commsched cannot reduce."""
    if grad.is_sparse or grad.layout != torch.strided:
        raise ValueError(
            f"parameter {name!r} has a sparse gradient ({grad.layout}); commsched reduces dense gradients only. "
            "Use nn.Embedding(sparse=False) or keep that parameter out of the optimizer given to DistributedOptimizer."
        )
    if grad.dtype not in _SUPPORTED:
        raise ValueError(f"parameter {name!r} has a {grad.dtype} gradient; "
                         "supported: float32, float64, float16, bfloat16")
