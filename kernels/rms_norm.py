"""RMSNorm in Triton, optionally fused with the residual add before it (vLLM's fused_add_rms_norm).

`rms_norm_ref` (rms_norm_ref.py) is the specification: transformers' RMSNorm op order (normalise in float32,
cast to the input dtype, then scale by the weight), after `x + residual` in the input dtype; with
`unit_offset`, `gemma_rms_norm_ref` (scale by 1 + weight in float32, one rounding). The kernel reproduces
every one of those roundings; only the order of the sum of squares differs. Knows nothing of models or layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch
from .rms_norm_ref import gemma_rms_norm_ref, rms_norm_ref

__all__ = ["DTYPES", "gemma_rms_norm_ref", "launch_config", "rms_norm", "rms_norm_ref"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The row count is not specialised (1 / multiple of 16 / other would compile three variants per shape), so
# warm-up covers every token count a step can have.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, num_rows, eps, stride_x, stride_res, stride_out,
    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched as a programmatic dependent: the previous kernel's writes land before any read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next may launch now; it waits for this one the same way
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]: small hidden sizes take several rows
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < HIDDEN
    mask = (rows < num_rows)[:, None] & col_mask[None, :]  # [R, BH]
    rows = rows.to(tl.int64)[:, None]  # row * stride can pass 2**31 for long prompts with large rows
    x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows * stride_res + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)  # torch's `x + residual`: one rounding to dtype
        tl.store(res_ptr + rows * stride_res + cols[None, :], x, mask=mask)  # the new residual stream
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / HIDDEN  # [R]; padded columns hold 0
    normed = xf * tl.math.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: (1 + w) times the float32 norm, rounded once
        out = (normed * (1.0 + w[None, :])).to(out_ptr.dtype.element_ty)
    else:  # transformers casts before the weight; weight * x in dtype: one more rounding
        out = (w[None, :] * normed.to(dtype).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows * stride_out + cols[None, :], out, mask=mask)


def launch_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_H, ROWS, num_warps) for a hidden size: a whole row per program, several rows when rows are short,
    and enough warps that each thread holds a few 16-byte vectors. Depends on the shape only (CUDA graphs)."""
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, min(16, 1024 // block_h))
    elems = rows * block_h
    num_warps = 4 if elems <= 1024 else 8 if elems <= 4096 else 16
    return block_h, rows, num_warps


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H]; got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected one of float32, float16, bfloat16")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [H] = ({x.shape[1]},) to match x")
    tensors = {"x": x, "weight": weight, "residual": residual, "out": out}
    for name, t in tensors.items():
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; expected x's dtype {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: all inputs must share one device")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1); got strides {t.stride()}")
        if name in ("residual", "out") and t.shape != x.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} must equal x's shape {tuple(x.shape)}")
    if residual is not None and out is not None and out.data_ptr() == residual.data_ptr():
        raise ValueError("out must not alias residual: residual receives x + residual, out the normed rows")


def rms_norm(
    x: torch.Tensor,  # [T, H], rows may be strided
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]: becomes x + residual, in place
    out: torch.Tensor | None = None,  # [T, H]; may be x itself
    unit_offset: bool = False,  # Gemma's form: scale by (1 + weight) in float32 (gemma_rms_norm_ref)
    pdl: bool = False,  # a programmatic dependent launch (CUDA, Hopper or newer): see kernels/pdl.py
) -> torch.Tensor:
    """RMSNorm(x), or with `residual`: residual <- x + residual (in place), then RMSNorm(residual).

    Same dtype everywhere (float32, float16 or bfloat16). Returns `out` (allocated when None, the only
    allocation). Grid and constants depend on shapes only, so the launch is CUDA-graph safe.
    """
    _check(x, weight, residual, out)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows, hidden = x.shape
    if num_rows == 0:
        return out
    block_h, rows, num_warps = launch_config(hidden)
    res = residual if residual is not None else x  # unused without HAS_RESIDUAL; any valid pointer
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x, res, weight, out, num_rows, eps, x.stride(0), res.stride(0), out.stride(0),
        HIDDEN=hidden, BLOCK_H=block_h, ROWS=rows, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
        PDL=pdl, num_warps=num_warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out
