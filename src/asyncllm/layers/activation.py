"""The gated MLP activation: silu(gate) * up over a packed [gate | up] projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2 * I] -> [..., I]: the first half is the gate, the second the up projection."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
