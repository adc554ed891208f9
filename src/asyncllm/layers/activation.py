"""The gated MLP activation: silu(gate) * up over a packed [gate | up] projection output, in torch (the
specification, `asyncllm.kernels.silu_mul_ref`) or through the fused Triton kernel (`asyncllm.kernels.silu_mul`).
Another gate (Gemma's GELU-tanh) is another class beside this one, chosen by `FamilySpec.activation`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from asyncllm.kernels.silu_mul_ref import silu_and_mul_ref
from asyncllm.layers.fusion import Fusable


class SiluAndMul(nn.Module, Fusable):
    def __init__(self) -> None:
        super().__init__()
        self._kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.silu_mul import silu_and_mul

        self._kernel = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and x.dim() == 2:
            return self._kernel(x)
        return silu_and_mul_ref(x)
