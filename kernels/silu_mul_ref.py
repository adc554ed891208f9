"""The specification of the gated-MLP activation, in pure PyTorch: silu(gate) * up over a packed [gate | up]
projection output. The layer's torch path (`layers/activation.py`) calls it, the Triton kernel (`silu_mul.py`)
is tested against it. Imports only torch. Another gate (Gemma's GELU-tanh) gets its own function here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: the first half is the gate, the second the up projection; torch's roundings
    (silu in float32 rounded to x's dtype, then the product rounded)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
