"""The gated-MLP activation in Triton: silu(gate) * up over a packed [gate | up] projection output.

`silu_and_mul_ref` (silu_mul_ref.py) is the specification: `F.silu(gate) * up` with torch's roundings (silu
computed in float32 and rounded to the input dtype, then the product computed in float32 and rounded). Knows
nothing of models.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .silu_mul_ref import silu_and_mul_ref

__all__ = ["DTYPES", "MAX_BLOCK", "silu_and_mul", "silu_and_mul_ref"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK = 1024  # columns per program: 8 per thread over 4 warps, i.e. one 16-byte vector each in 16-bit


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, INTER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK]
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch: x / (1 + exp(-x)) in float32 with IEEE division, rounded to the input dtype before the product.
    act = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _check(x: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be 2-D [T, 2 * I] with an even last dim; got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected one of float32, float16, bfloat16")
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dim (stride(-1) == 1); got strides {x.stride()}")
    if out is None:
        return
    expected = (x.shape[0], x.shape[1] // 2)
    if out.shape != expected:
        raise ValueError(f"out shape {tuple(out.shape)} must be [T, I] = {expected}")
    if out.dtype != x.dtype:
        raise TypeError(f"out has dtype {out.dtype}; expected x's dtype {x.dtype}")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, x on {x.device}: both must share one device")
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in its last dim (stride(-1) == 1); got strides {out.stride()}")


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I]: gate then up, rows may be strided
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] into `out` (allocated when None, the only allocation); float32, float16 or
    bfloat16. Grid and constants depend on shapes only, so the launch is CUDA-graph safe."""
    _check(x, out)
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows == 0 or inter == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    return out
