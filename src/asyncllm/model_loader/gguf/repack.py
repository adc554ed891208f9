"""GGUF block types kept quantized: a tensor's blocks repacked into the quantized layers' layout
(kernels/quant_matmul_ref.py), so the GPU reads 4 or 8 bits a weight instead of 16.

Each type is first read as it is: unsigned codes, one scale per group and a zero point or a min per group
(Q8_0: codes q + 128, zero 128; Q4_0: zero 8; Q4_1: mins; Q4_K / Q5_K: scales d * sc and mins -dmin * m per 32;
Q6_K: scales d * sc per 16, zero 32), then written in the layer's layout (`quantization.gguf_types`), which
may be wider: codes in 8-bit fields, a scale repeated over smaller groups, zero points as mins -z * s, float16
scales as float32. Every step is exact: the layout's weights equal gguf's own dequantization bit for bit.
Which layout a tensor gets is the scheme's (`QuantScheme.layer_scheme`); knows no names.
"""

from __future__ import annotations

import torch

from asyncllm.kernels.quant_matmul_ref import pack_codes
from asyncllm.quantization.scheme import QuantScheme

_F16 = torch.float16
SUPER = 256  # the K-quants' super-block


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """[n, 1] float16: the float16 stored at byte `at` of each block."""
    return blocks[:, at : at + 2].contiguous().view(_F16)


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Codes from packed bytes [n, B]: each run of `run` bytes holds `run` elements in its low nibbles, then the
    next `run` in its high ones -> [n, 2 B] int32."""
    runs = qs.reshape(qs.shape[0], -1, 1, run).to(torch.int32)
    return torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(qs.shape[0], -1)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes [n, 12] -> the 8 sub-blocks' 6-bit scales and mins, each [n, 8] float32."""
    b = packed.to(torch.int32).reshape(-1, 3, 4)
    d, m, md = b[:, 0], b[:, 1], b[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


# Each reader: blocks [n, bytes] -> (codes [n, elements], scales [n, groups], zero point or None, mins or None).
Read = tuple[torch.Tensor, torch.Tensor, int | None, torch.Tensor | None]


def _q8_0(b: torch.Tensor) -> Read:
    return b[:, 2:].contiguous().view(torch.int8).to(torch.int32) + 128, _halves(b, 0), 128, None


def _q4_0(b: torch.Tensor) -> Read:
    return _nibbles(b[:, 2:], 16), _halves(b, 0), 8, None


def _q4_1(b: torch.Tensor) -> Read:
    return _nibbles(b[:, 4:], 16), _halves(b, 0), None, _halves(b, 2)


def _q4_k(b: torch.Tensor) -> Read:  # d, dmin, 12 bytes of scales, 128 of nibbles (4 runs of 32: 64 elements each)
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dmin = _halves(b, 0).float(), _halves(b, 2).float()
    return _nibbles(b[:, 16:], 32), d * sc, None, -(dmin * mn)


def _q5_k(b: torch.Tensor) -> Read:  # Q4_K's, plus 32 bytes whose bit j is the 5th bit of sub-block j
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dmin = _halves(b, 0).float(), _halves(b, 2).float()
    high = (b[:, 16:48].to(torch.int32)[:, None, :] >> torch.arange(8, device=b.device)[None, :, None]) & 1
    codes = _nibbles(b[:, 48:], 32) | (high.reshape(b.shape[0], -1) << 4)
    return codes, d * sc, None, -(dmin * mn)


def _q6_k(b: torch.Tensor) -> Read:  # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64)  # 2 runs of 64 bytes: 128 elements each
    shifts = torch.arange(0, 8, 2, device=b.device)[None, None, :, None]
    high = (b[:, 128:192].to(torch.int32).reshape(n, 2, 1, 32) >> shifts) & 3  # [n, 2 halves, 4 quarters, 32]
    codes = low | (high.reshape(n, -1) << 4)
    scales = _halves(b, 208).float() * b[:, 192:208].contiguous().view(torch.int8).float()
    return codes, scales, 32, None


# type name -> (bytes per block, elements per block, reader)
_READERS = {
    "Q8_0": (34, 32, _q8_0),
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q4_K": (144, SUPER, _q4_k),
    "Q5_K": (176, SUPER, _q5_k),
    "Q6_K": (210, SUPER, _q6_k),
}


def repack(raw: torch.Tensor, type_name: str, shape: tuple[int, ...], layout: QuantScheme) -> dict[str, torch.Tensor]:
    """A [N, K] tensor's bytes (uint8, 1-d) in `layout` -> {"qweight", "scales", and "qzeros" or "mins"},
    each [N, ...]."""
    size, elements, read = _READERS[type_name]
    n, k = shape
    codes, scales, zero, mins = read(raw.view(-1, size))  # blocks row-major: each row's blocks in order
    group = layout.group_size
    assert group is not None and elements % group == 0, (type_name, layout)
    per = elements // scales.shape[1] // group  # the layout's groups per group of the type
    scales = scales.reshape(n, -1).repeat_interleave(per, dim=1)  # [N, K / group]
    out = {"qweight": pack_codes(codes.reshape(n, k), layout.bits), "scales": scales}
    if layout.zero_point:
        assert zero is not None, (type_name, layout)
        out["qzeros"] = torch.full(scales.shape, zero, dtype=torch.uint8, device=raw.device)
    else:
        if zero is not None:
            mins = -zero * scales.float()  # exact: z is a power of two
        assert mins is not None, type_name
        out["mins"] = mins.reshape(n, -1).repeat_interleave(per if zero is None else 1, dim=1)
    assert scales.dtype == _F16 or layout.scale_dtype == "float32", (type_name, layout)  # never narrowed
    kept = getattr(torch, layout.scale_dtype)
    return {param: t.to(kept) if t.is_floating_point() else t for param, t in out.items()}
