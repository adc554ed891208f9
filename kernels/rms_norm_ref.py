"""The specification of RMSNorm and of RMSNorm fused with the residual add before it, in pure PyTorch: the
layers' torch path (`layers/norm.py`) calls these, the Triton kernel (`rms_norm.py`) is tested against them.

transformers' LlamaRMSNorm / Qwen3RMSNorm op for op, so float32 outputs equal transformers' bit for bit; and
Gemma's form (`gemma_rms_norm_ref`: scaled by 1 + w in float32, rounded once), Gemma3RMSNorm op for op.
Imports only torch.
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Normalise over the last dim in float32, cast back to x's dtype, then scale by the weight.

    With `residual`, the fused kernel's contract: residual <- x + residual (in place), then its norm.
    """
    if residual is not None:
        out, h = add_rms_norm_ref(x, residual, weight, eps)
        residual.copy_(h)
        return out
    in_dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(in_dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (rounded to x's dtype); returns (norm(h), h) and leaves both inputs untouched.

    IEEE addition commutes: the same bits as transformers' decoder layer's `residual + x`.
    """
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


def gemma_rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Gemma's RMSNorm: normalise over the last dim in float32 and scale by (1 + weight) there, then cast to
    x's dtype once (transformers' Gemma3RMSNorm; its weight is stored zero-centred). With `residual`, the
    fused kernel's contract: residual <- x + residual (in place), then its norm."""
    if residual is not None:
        out, h = gemma_add_rms_norm_ref(x, residual, weight, eps)
        residual.copy_(h)
        return out
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def gemma_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (rounded to x's dtype); returns (gemma_rms_norm(h), h), inputs untouched."""
    h = x + residual
    return gemma_rms_norm_ref(h, weight, eps), h
