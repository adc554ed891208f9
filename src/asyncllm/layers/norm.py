"""RMSNorm with the exact op order of transformers' Llama/Qwen norms, so fp32 outputs match bit for bit;
optionally with the residual add folded in (`x, residual = norm(x, residual)`), and optionally through the
fused Triton kernel (`asyncllm.kernels.rms_norm`). The torch form calls the specification both are held to,
`asyncllm.kernels.rms_norm_ref`.

Knows nothing about where it sits in a model; the weight is loaded from a checkpoint, never initialised here.
Another norm form (Gemma's `x * (1 + w)`) is another class beside this one, chosen by a model family's
`FamilySpec.norm`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
from torch import nn

from asyncllm.kernels.rms_norm_ref import add_rms_norm_ref, rms_norm_ref
from asyncllm.layers.fusion import Fusable


class RMSNorm(nn.Module, Fusable):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self._kernel: Callable[..., Any] | None = None  # the fused kernel, once enable_fused_kernels ran

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.rms_norm import rms_norm

        self._kernel = rms_norm

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: h = x + residual (rounded to x's dtype), returns (norm(h), h).

        The fused kernel writes h into `residual` in place; the twin returns a new tensor. Either way the
        caller continues with the returned pair.
        """
        if self._kernel is not None and x.dim() == 2:
            out = self._kernel(x, self.weight, self.eps, residual=residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        return add_rms_norm_ref(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, fused={self._kernel is not None}"
