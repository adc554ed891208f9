"""The gated MLP activation: silu(gate) * up over a packed [gate | up] projection output, in torch or
through the fused Triton kernel (`asyncllm.kernels.silu_mul`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: the first half is the gate, the second the up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
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
