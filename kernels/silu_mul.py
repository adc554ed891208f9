"""The gated-MLP activations in Triton: silu(gate) * up, or Gemma's gelu_tanh(gate) * up, over a packed
[gate | up] projection output.

`silu_and_mul_ref` and `gelu_tanh_and_mul_ref` (silu_mul_ref.py) are the specifications: `F.silu(gate) * up`
and `F.gelu(gate, approximate="tanh") * up` with torch's roundings (the activation computed in float32 and
rounded to the input dtype, then the product computed in float32 and rounded). Knows nothing of models.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .silu_mul_ref import gelu_tanh_and_mul_ref, silu_and_mul_ref

__all__ = ["DTYPES", "MAX_BLOCK", "gelu_tanh_and_mul", "gelu_tanh_and_mul_ref", "silu_and_mul", "silu_and_mul_ref"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK = 1024  # columns per program: 8 per thread over 4 warps, i.e. one 16-byte vector each in 16-bit


# A jitted kernel may read a module global only when it is a tl.constexpr (the interpreter reads any).
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # torch's kBeta for the tanh GELU: sqrt(2 / pi)


@triton.jit
def _gated_act_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, INTER: tl.constexpr, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK]
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:
        # torch: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) in float32, with tanh(y) = 1 - 2 / (e^2y + 1)
        # (long-standing tl ops only). |y| is clamped at 15, where float32's tanh is already +-1: e^2y never
        # overflows.
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        act = (0.5 * g * (1.0 + tanh)).to(gate.dtype)
    else:
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
    return _gated(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(
    x: torch.Tensor,  # [T, 2 * I]: gate then up, rows may be strided
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    """gelu_tanh(x[:, :I]) * x[:, I:] (Gemma's GeGLU), as `silu_and_mul` otherwise."""
    return _gated(x, out, gelu_tanh=True)


def _gated(x: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    _check(x, out)
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows == 0 or inter == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(inter))
    _gated_act_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, GELU_TANH=gelu_tanh,
        num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    return out
