"""The specification of the gated-MLP activations, in pure PyTorch: silu(gate) * up (Llama, Qwen) or
gelu_tanh(gate) * up (Gemma's GeGLU) over a packed [gate | up] projection output. The layers' torch path
(`layers/activation.py`) calls them, the Triton kernels (`silu_mul.py`) are tested against them. Imports only
torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: the first half is the gate, the second the up projection; torch's roundings
    (silu in float32 rounded to x's dtype, then the product rounded)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: gelu(gate, approximate="tanh") * up, transformers' `gelu_pytorch_tanh` gate
    with torch's roundings (the GELU in float32 rounded to x's dtype, then the product rounded)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
