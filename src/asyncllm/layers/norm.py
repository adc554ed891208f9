"""RMSNorm with the exact op order of transformers' Llama/Qwen norms, so fp32 outputs match bit for bit.

Knows nothing about where it sits in a model; the weight is loaded from a checkpoint, never initialised here.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dim in float32, cast back to x's dtype, then scale by the weight."""
        in_dtype = x.dtype
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        return self.weight * xf.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
