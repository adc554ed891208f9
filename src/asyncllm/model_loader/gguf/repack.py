"""GGUF block types kept quantized: a tensor's 32-element blocks repacked into the quantized layers' layout
(kernels/quant_matmul_ref.py), so the GPU reads 4 or 8 bits a weight instead of 16.

Q8_0 (d, 32 int8; x = d * q) becomes 8-bit codes q + 128 with zero point 128; Q4_0 (d, 16 bytes of nibbles;
x = d * (q - 8)) 4-bit codes with zero point 8; Q4_1 (d, m, nibbles; x = d * q + m) 4-bit codes with mins.
Scales and mins stay float16, as stored: the layout's weights equal `dequant.py`'s exactly. Which types a
file must use to be kept quantized is decided with the scheme (`quantization.scheme`); knows no names.
"""

from __future__ import annotations

import torch

from asyncllm.kernels.quant_matmul_ref import pack_codes

GROUP = 32  # elements per block of every type here
# type name -> (bytes per block, bits per code, zero point or None for mins)
KEPT_TYPES: dict[str, tuple[int, int, int | None]] = {"Q8_0": (34, 8, 128), "Q4_0": (18, 4, 8), "Q4_1": (20, 4, None)}


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """[n] float16: the float16 stored at byte `at` of each block."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16)[:, 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 32] from [n, 16] bytes: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def repack(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A [N, K] tensor's bytes (uint8, 1-d) -> {"qweight", "scales", and "qzeros" or "mins"}, each [N, ...]."""
    size, bits, zero = KEPT_TYPES[type_name]
    n, k = shape
    blocks = raw.view(-1, size)  # [N * K / 32, bytes], row-major: each row's blocks in order
    groups = k // GROUP
    if type_name == "Q8_0":
        codes = (blocks[:, 2:].contiguous().view(torch.int8).to(torch.int32) + 128).reshape(n, k)
    else:
        codes = _nibbles(blocks[:, 2 if zero is not None else 4 :]).reshape(n, k)
    out = {"qweight": pack_codes(codes, bits), "scales": _halves(blocks, 0).reshape(n, groups)}
    if zero is None:
        out["mins"] = _halves(blocks, 2).reshape(n, groups)
    else:
        out["qzeros"] = torch.full((n, groups), zero, dtype=torch.uint8, device=raw.device)
    return out
