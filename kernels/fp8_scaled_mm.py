"""The W8A8 FP8 GEMM: activations quantized to e4m3 per token (dynamic scales), multiplied by e4m3 weights
with one scale per output channel on the tensor cores through `torch._scaled_mm` (cuBLASLt), bfloat16 out.

`fp8_w8a8_matmul_ref` (quant_matmul_ref.py) is the specification: the same activation quantization (the one
torch function both call), then float32 products. Needs CUDA compute capability 9.0 (Hopper) for row-wise
scales; the caller checks `supports_w8a8`. Knows nothing of models.
"""

from __future__ import annotations

import torch

from .quant_matmul_ref import FP8_DTYPE, fp8_w8a8_matmul_ref, quantize_fp8_per_token

__all__ = ["fp8_w8a8_matmul", "fp8_w8a8_matmul_ref", "supports_w8a8"]


def supports_w8a8(device: torch.device) -> bool:
    """Row-wise scaled FP8 GEMMs run here: CUDA with compute capability >= 9.0."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_w8a8_matmul(
    x: torch.Tensor,  # [M, K] bfloat16, contiguous
    qweight: torch.Tensor,  # [N, K] e4m3, contiguous: its transpose is the column-major operand cuBLASLt takes
    scale_row: torch.Tensor,  # [1, N] float32: the weight's per-channel scales, laid out as a row
    *,
    bias: torch.Tensor | None = None,  # [N]
    scale_ub: float | None = None,
) -> torch.Tensor:  # [M, N] bfloat16
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"x must be a 2-D bfloat16 tensor (row-wise scaled FP8 outputs bfloat16); got {x.dtype}")
    if qweight.dtype != FP8_DTYPE or not qweight.is_contiguous():
        raise ValueError("qweight must be a contiguous float8_e4m3fn [N, K]")
    n, k = qweight.shape
    if x.shape[1] != k or k % 16 or n % 16:
        raise ValueError(f"x [M, {x.shape[1]}] against weight [N={n}, K={k}]: K and N must match and divide by 16")
    if tuple(scale_row.shape) != (1, n) or scale_row.dtype != torch.float32:
        raise ValueError(f"scale_row must be float32 [1, N={n}]")
    xq, x_scale = quantize_fp8_per_token(x.contiguous(), scale_ub)  # [M, K] e4m3, [M, 1] float32
    out = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=scale_row, out_dtype=torch.bfloat16)
    return out if bias is None else out + bias.to(out.dtype)
