"""RMSNorm with the exact op order of transformers' Llama/Qwen norms, so fp32 outputs match bit for bit;
optionally with the residual add folded in (`x, residual = norm(x, residual)`), and optionally through the
fused Triton kernel (`asyncllm.kernels.rms_norm`). The torch form calls the specification both are held to,
`asyncllm.kernels.rms_norm_ref`.

Knows nothing about where it sits in a model; the weight is loaded from a checkpoint, never initialised here.
`GemmaRMSNorm` is Gemma's form (`x * (1 + w)` in float32, rounded once), chosen by a model family's
`FamilySpec.norm`; the same kernel computes either (`unit_offset`). `LayerNorm` is an encoder's (BERT's): torch's
op with a loaded weight and bias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, overload

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.kernels.rms_norm_ref import (
    add_rms_norm_ref,
    gemma_add_rms_norm_ref,
    gemma_rms_norm_ref,
    rms_norm_ref,
)
from asyncllm.layers.fusion import Fusable, LaunchesPdl
from asyncllm.layers.param_dtype import empty_parameter


class RMSNorm(nn.Module, Fusable, LaunchesPdl):
    unit_offset: ClassVar[bool] = False  # scale by (1 + weight) in float32, rounded once (Gemma's form)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_parameter(dim)
        self.eps = eps
        self._kernel: Callable[..., Any] | None = None  # the fused kernel, once enable_fused_kernels ran
        self._pdl = False  # its launches programmatic dependents (use_pdl)

    @property
    def fused(self) -> bool:
        """Whether the fused kernel is on."""
        return self._kernel is not None

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.rms_norm import rms_norm

        self._kernel = rms_norm

    def use_pdl(self, on: bool) -> None:
        self._pdl = on

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
            out = self._kernel(x, self.weight, self.eps, residual=residual, unit_offset=self.unit_offset, pdl=self._pdl)
            return out if residual is None else (out, residual)
        if residual is None:
            return (gemma_rms_norm_ref if self.unit_offset else rms_norm_ref)(x, self.weight, self.eps)
        return (gemma_add_rms_norm_ref if self.unit_offset else add_rms_norm_ref)(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, fused={self._kernel is not None}"


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma3RMSNorm: normalise in float32, scale by (1 + weight) there, cast once; the weight
    is stored zero-centred, as the checkpoint holds it. Its fused form is the same kernel (`unit_offset`)."""

    unit_offset = True


class LayerNorm(nn.Module):
    """torch's LayerNorm over the last dim (what transformers' BERT computes), weight and bias loaded, never
    initialised here. No fused form: F.layer_norm is one kernel already."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = empty_parameter(dim)
        self.bias = empty_parameter(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
