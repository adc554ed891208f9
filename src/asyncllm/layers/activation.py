"""The gated MLP activations over a packed [gate | up] projection output: silu(gate) * up (`SiluAndMul`) and
Gemma's GeGLU, gelu_tanh(gate) * up (`GeluTanhAndMul`), each in torch (the specification,
`asyncllm.kernels.silu_mul_ref`) or through its fused Triton kernel (`asyncllm.kernels.silu_mul`). A family
picks one with `FamilySpec.activation`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from asyncllm.kernels.silu_mul_ref import gelu_tanh_and_mul_ref, silu_and_mul_ref
from asyncllm.layers.fusion import Fusable


class SiluAndMul(nn.Module, Fusable):
    def __init__(self) -> None:
        super().__init__()
        self._kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def fused(self) -> bool:
        """Whether the fused kernel is on."""
        return self._kernel is not None

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.silu_mul import silu_and_mul

        self._kernel = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and x.dim() == 2:
            return self._kernel(x)
        return silu_and_mul_ref(x)


class GeluTanhAndMul(nn.Module, Fusable):
    """transformers' `gelu_pytorch_tanh` gate times up (Gemma's MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self._kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.silu_mul import gelu_tanh_and_mul

        self._kernel = gelu_tanh_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and x.dim() == 2:
            return self._kernel(x)
        return gelu_tanh_and_mul_ref(x)
