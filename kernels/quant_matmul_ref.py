"""The specification of quantized linear weights and their matmul, in pure PyTorch: the layout every quantized
checkpoint is converted to at load, its dequantization, and y = x W^T (+ b) over it in float32.

The layout: one row per output feature, groups of `group_size` consecutive inputs along each row.
- `qweight`: integer codes packed along the row into int32 words, `32 // bits` codes a word, the code of input
  k at bits [bits * (k % P), bits * (k % P) + bits) of word k // P (P = 32 // bits), unsigned: [N, K / P]
  int32 (bits 4 or 8); or e4m3 values [N, K] float8_e4m3fn.
- `scales`: [N, ceil(K / group_size)], one per group (any float dtype).
- `qzeros`: [N, ceil(K / group_size)] uint8, integer zero points of integer codes, or None.
- `mins`: [N, ceil(K / group_size)] float, offsets added per group (GGUF's Q4_1), or None.
The weight of (n, k) is (q - z) * s for integer codes with zero points, q * s + m with mins, q * s otherwise,
computed in float32 (exact but for the + m: a code times a 16-bit scale fits float32's mantissa). The quantized
layers' torch path, the Triton kernel (quant_matmul.py) and the loaders' tests use these functions. Imports only
torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def codes_per_word(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: integer codes are 4 or 8 bits")
    return 32 // bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] codes in [0, 2**bits) -> [N, K / P] int32 words, code k at bits bits * (k % P) of word k // P."""
    per = codes_per_word(bits)
    n, k = codes.shape
    if k % per:
        raise ValueError(f"{k} inputs do not fill {bits}-bit words of {per} codes")
    grouped = codes.to(torch.int64).reshape(n, k // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    words = (grouped << shifts).sum(dim=-1)  # the codes' bits do not overlap: the sum is their OR
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as signed 32-bit: the top code's high bit is the sign


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K / P] int32 words -> [N, K] int32 codes in [0, 2**bits)."""
    per = codes_per_word(bits)
    shifts = torch.arange(per, device=qweight.device, dtype=torch.int32) * bits
    codes = (qweight[:, :, None] >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then masked
    return codes.reshape(qweight.shape[0], -1)


def dequantize_ref(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float32 weight [N, K] of the layout above."""
    if qweight.dtype == FP8_DTYPE:
        q = qweight.float()
    else:
        q = unpack_codes(qweight, bits).float()
    k = q.shape[1]

    def per_input(groups: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [N, K] float32
        return groups.float().repeat_interleave(group_size, dim=1)[:, :k]

    if qzeros is not None:
        q = q - per_input(qzeros)
    w = q * per_input(scales)
    return w if mins is None else w + per_input(mins)


def quant_matmul_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    mins: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """x W^T (+ b) in float32 over the dequantized weight, rounded once to x's dtype."""
    w = dequantize_ref(qweight, scales, qzeros, bits=bits, group_size=group_size, mins=mins)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as e4m3 codes [N, K] and one float32 scale per row [N, 1]: the row's largest
    magnitude maps to 448 (`quantization="fp8"` at load). Rows of zeros get a tiny scale and zero codes."""
    amax = weight.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    codes = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def quantize_fp8_per_token(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] as e4m3 [M, K] and one float32 scale per row [M, 1] (dynamic, per token): the row's
    largest magnitude, capped at `scale_ub` when given (fbgemm checkpoints' activation_scale_ub), maps to 448."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scale = amax.clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_w8a8_matmul_ref(
    x: torch.Tensor,  # [M, K], bfloat16
    qweight: torch.Tensor,  # [N, K] e4m3
    scales: torch.Tensor,  # [N, 1] float32: one per output channel
    *,
    bias: torch.Tensor | None = None,
    scale_ub: float | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """The W8A8 matmul: activations quantized per token (`quantize_fp8_per_token`), both operands' e4m3 values
    multiplied in float32 and scaled by the token's and the channel's scales, rounded once to x's dtype."""
    xq, x_scale = quantize_fp8_per_token(x, scale_ub)
    y = (xq.float() @ qweight.float().t()) * x_scale * scales.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
