"""Quantized linear weights kept packed on CPU, in the form torch's CPU weight-only int4 kernel reads
(`aten._weight_int4pack_mm_for_cpu`): 4-bit codes in its tiled order, one (scale, zero) pair per group in the
activations' 16-bit type, and w = (q - 8) * scale + zero.

Our layout (kernels/quant_matmul_ref.py: w = q * s + c, c the zero point's -z * s or the min) maps onto that
exactly but for the 16-bit rounding of each group's pair: 4-bit codes as they are (zero = c + 8 s); 8-bit codes
(Q8_0, GPTQ 8-bit, Q5_K) as two 4-bit planes side by side along the inputs, q = 16 h + l, the high plane with
scale 16 s and the low one with scale s, each input fed to both (the GGUF Q8_0 head the same, after
`requantize_int8`). Activations go in as bfloat16, and only where the CPU computes bfloat16 natively (AVX512-BF16
or AMX: `supported`); elsewhere the kernel runs scalar and the dequantized float32 weight is faster.
The dequantized float32 weight (`dequantize_ref`) is the specification this form is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncllm.kernels.quant_matmul_ref import FP8_DTYPE, unpack_codes

KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes the kernel takes
TILE_N = 64  # the kernel packs output rows in tiles of 64: code n of tile t sits in byte (t, k, n % 32)
# Above this many token rows the kernel (a GEMV per row block) loses to dequantizing the whole weight to
# bfloat16 once and a dense bfloat16 GEMM (AMX where the CPU has it): prompt chunks take that path.
INT4_MAX_ROWS = 32
_ACT = torch.bfloat16


def supported() -> bool:
    """Whether this CPU runs the packed form fast: torch has the kernel and the CPU computes bfloat16 natively."""
    ops = torch.ops.aten
    if not (hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")):
        return False
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


@dataclass
class Int4Weight:
    """One linear layer's weight [out_features, in_features] in the kernel's form."""

    packed: torch.Tensor  # [N, planes * K / 2] uint8, the kernel's tiled order
    scale_zeros: torch.Tensor  # [planes * K / group, N, 2] bfloat16: (scale, zero) per group
    group_size: int
    planes: int  # 1: 4-bit codes; 2: 8-bit codes as a high and a low plane along the inputs
    in_features: int
    out_features: int

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scale_zeros.numel() * 2


def kernel_group(in_features: int, group_size: int) -> int | None:
    """The kernel's group for a layer whose scales repeat every `group_size` inputs (the whole row: in_features):
    the largest of KERNEL_GROUPS dividing both, or None where none does."""
    fits = [g for g in KERNEL_GROUPS if group_size % g == 0 and in_features % g == 0]
    return max(fits) if fits else None


def packable(out_features: int, in_features: int, bits: int, group_size: int, fp8: bool = False) -> bool:
    return (
        not fp8 and bits in (4, 8) and out_features % TILE_N == 0 and kernel_group(in_features, group_size) is not None
    )


def pack(
    qweight: torch.Tensor,  # [N, K / P] int32, our layout
    scales: torch.Tensor,  # [N, K / group_size]
    qzeros: torch.Tensor | None,  # [N, K / group_size] uint8
    mins: torch.Tensor | None,  # [N, K / group_size]
    *,
    bits: int,
    group_size: int,
) -> Int4Weight:
    """Our layout's weight in the kernel's form (`packable` must hold)."""
    assert qweight.dtype != FP8_DTYPE, "e4m3 codes have no int4 form"
    codes = unpack_codes(qweight, bits)  # [N, K] int32 in [0, 2**bits)
    n, k = codes.shape
    group = kernel_group(k, group_size)
    assert group is not None and n % TILE_N == 0, (n, k, group_size)
    per = group_size // group  # our groups are `per` kernel groups each: their scales repeat
    s = scales.float().repeat_interleave(per, dim=1)[:, : k // group]  # [N, K / group] float32
    c = torch.zeros_like(s)
    if qzeros is not None:
        c = -qzeros.float().repeat_interleave(per, dim=1)[:, : k // group] * s
    if mins is not None:
        c = c + mins.float().repeat_interleave(per, dim=1)[:, : k // group]
    if bits == 4:
        planes, plane_codes, plane_pairs = 1, codes, [(s, c + 8 * s)]
    else:
        # q = 16 h + l: 16 s (h - 8) + 128 s  +  s (l - 8) + 8 s  =  q s; the offset c rides on the high plane.
        planes, plane_codes = 2, torch.cat((codes >> 4, codes & 0x0F), dim=1)
        plane_pairs = [(16 * s, 128 * s + c), (s, 8 * s)]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(plane_codes.contiguous(), 1)
    pairs = torch.cat([torch.stack(p, dim=-1) for p in plane_pairs], dim=1)  # [N, planes * K / group, 2]
    scale_zeros = pairs.transpose(0, 1).to(_ACT).contiguous()
    return Int4Weight(packed, scale_zeros, group, planes, k, n)


def requantize_int8(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as 8-bit codes in our layout with one scale per `group_size` inputs, symmetric
    (codes q + 128, zero 128, scale amax / 127): llama.cpp's own Q8_0 rule, so a Q8_0 weight read back as floats
    gets its codes and scales back exactly. Returns (qweight [N, K / 4] int32, scales float32, qzeros uint8)."""
    from asyncllm.kernels.quant_matmul_ref import pack_codes

    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / 127.0  # [N, K / group]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / safe[..., None]).clamp(-127, 127).to(torch.int32) + 128
    zeros = torch.full(scale.shape, 128, dtype=torch.uint8)
    return pack_codes(codes.reshape(n, k), 8), scale, zeros


def dequantize(w: Int4Weight) -> torch.Tensor:
    """The weight [N, K] in bfloat16, from the kernel's form (the prompt-chunk path)."""
    n, pk = w.out_features, w.in_features * w.planes
    tiles = w.packed.view(n // TILE_N, pk, TILE_N // 2)  # [tiles, PK, 32]: low nibbles rows 0..31, high 32..63
    codes = torch.stack((tiles & 0x0F, tiles >> 4), dim=1)  # [tiles, 2, PK, 32] uint8
    out = torch.empty(n // TILE_N, 2, TILE_N // 2, pk, dtype=torch.float32)
    out.copy_(codes.transpose(2, 3))  # [tiles, 2, 32, PK]: row-major rows, converted in the same pass
    groups = out.view(n, pk // w.group_size, w.group_size)
    sz = w.scale_zeros.transpose(0, 1).float()  # [N, PK / group, 2]
    groups.sub_(8.0).mul_(sz[..., 0:1]).add_(sz[..., 1:2])
    full = groups.view(n, pk)
    if w.planes == 2:
        full = full[:, : w.in_features] + full[:, w.in_features :]
    return full.to(_ACT)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> x W^T (+ b) [M, N] in x's dtype; bfloat16 inputs to the kernel, float32 sums inside it."""
    xb = x.to(_ACT)
    if x.shape[0] > INT4_MAX_ROWS:
        y = F.linear(xb, dequantize(w))
    else:
        if w.planes == 2:
            xb = torch.cat((xb, xb), dim=1)  # each input meets its high and its low code
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), w.packed, w.group_size, w.scale_zeros)
    y = y.to(x.dtype)
    return y if bias is None else y + bias
