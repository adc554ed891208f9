"""The specification of the GEMV with a prologue (kernels/quant_matmul_gemv.py: `rms_norm_gemv`,
`silu_mul_gemv`), in pure PyTorch: the op before the linear layer exactly as its own reference computes it
(rms_norm_ref.py, silu_mul_ref.py: every rounding to the activations' dtype), then F.linear in float32 rounded
once, as `linear_gemv`'s specification. Imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rms_norm_ref import add_rms_norm_ref, rms_norm_ref
from .silu_mul_ref import silu_and_mul_ref


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def rms_norm_gemv_ref(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(linear(rms_norm(x)), None), or with `residual`: h = x + residual, (linear(rms_norm(h)), h); the inputs
    are left untouched."""
    if residual is None:
        return _linear(rms_norm_ref(x, norm_weight, eps), weight, bias), None
    normed, h = add_rms_norm_ref(x, residual, norm_weight, eps)
    return _linear(normed, weight, bias), h


def silu_mul_gemv_ref(
    x: torch.Tensor,  # [M, 2 K]: [gate | up]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    """linear(silu(gate) * up)."""
    return _linear(silu_and_mul_ref(x), weight, bias)
