"""The GEMV's prologues (kernels/quant_matmul_gemv.py): the op before a linear layer folded into its GEMV at
one token row, so the pair is one launch. Each program builds the activations of its own K tiles as it loads
them: RMSNorm (its row's rms over the whole input, computed redundantly by every program: K <= 8192 values
from L2), the residual add then RMSNorm (the post-attention norm), or silu(gate) * up over a [gate | up] row.
Each reproduces the roundings of the separate kernel it replaces (rms_norm.py, silu_mul.py); the
specifications are gemv_prologue_ref.py. Device code and its mode numbers only; knows nothing of layers.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The modes (the kernel's PROLOGUE). A jitted function may read a module global only when it is a tl.constexpr;
# the launchers pass the plain ints (`.value`).
NONE = tl.constexpr(0)  # the activations as they are
RMS_NORM = tl.constexpr(1)  # rms_norm_ref(x, norm_weight, eps)
ADD_RMS_NORM = tl.constexpr(2)  # h = x + residual; rms_norm_ref(h, norm_weight, eps); h written out
SILU_MUL = tl.constexpr(3)  # silu_and_mul_ref(x) over x = [gate | up], 2 K wide

# Columns per pass of the rms reduction: 16 float32 values a thread at 2 warps; a hidden size of 1024 (the
# 0.6B) in one pass, 4096 (the 8B) in four.
_RMS_CHUNK = tl.constexpr(1024)


@triton.jit
def inv_rms(x_row, a_row, h_row, K, eps, h_limit, PROLOGUE: tl.constexpr):
    """1 / sqrt(mean(h^2) + eps) of the row's whole input h (x, or x + residual rounded to x's dtype: torch's
    `x + residual`). h's first `h_limit` values (K in one program per token row, 0 in the others) are stored
    at h_row: a buffer no program reads, so the write races with nothing, while every program reads the
    unchanged x and residual."""
    acc = tl.zeros((_RMS_CHUNK,), dtype=tl.float32)
    for start in range(0, K, _RMS_CHUNK):
        offs = start + tl.arange(0, _RMS_CHUNK)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        if PROLOGUE == ADD_RMS_NORM:
            res = tl.load(a_row + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
            tl.store(h_row + offs, x, mask=offs < h_limit)
        xf = x.to(tl.float32)
        acc += xf * xf
    return tl.math.rsqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def activations(x_row, a_row, nw_ptr, offs, mask, rms, K, PROLOGUE: tl.constexpr, MASKED: tl.constexpr):
    """float32 activations at `offs` (any shape) after the prologue; `rms` is inv_rms's result (unused by
    NONE and SILU_MUL). MASKED: offsets past K read as 0 (the partial K tile)."""
    if MASKED:
        x = tl.load(x_row + offs, mask=mask, other=0.0)
    else:
        x = tl.load(x_row + offs)
    dtype = x.dtype
    if PROLOGUE == SILU_MUL:  # silu_mul.py's roundings: silu in float32 rounded, the product rounded
        if MASKED:
            up = tl.load(x_row + K + offs, mask=mask, other=0.0)
        else:
            up = tl.load(x_row + K + offs)
        g = x.to(tl.float32)
        act = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(dtype)
    if PROLOGUE == ADD_RMS_NORM:
        if MASKED:
            res = tl.load(a_row + offs, mask=mask, other=0.0)
        else:
            res = tl.load(a_row + offs)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
    # rms_norm.py's roundings: normed rounded, times w rounded (Triton's frontend has no `in`)
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:  # noqa: SIM109
        if MASKED:
            w = tl.load(nw_ptr + offs, mask=mask, other=0.0)
        else:
            w = tl.load(nw_ptr + offs)
        x = (w.to(tl.float32) * (x.to(tl.float32) * rms).to(dtype).to(tl.float32)).to(dtype)
    return x.to(tl.float32)


__all__ = ["ADD_RMS_NORM", "NONE", "RMS_NORM", "SILU_MUL", "activations", "inv_rms"]
