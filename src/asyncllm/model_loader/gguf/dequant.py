"""GGUF tensor bytes to float32 torch tensors: F32/F16/BF16 and the 32-element block types (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0) in torch, every other type through `gguf.quants` (numpy, several times slower).

The torch forms compute what `gguf.quants` computes, op for op in float32 (d * q, then + m), so both give the
same bits (tests/model_loader/test_gguf_dequant.py holds them to it). Knows nothing of names or models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_F16 = torch.float16


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """[n, 1] float32: the float16 stored at byte `at` of each block."""
    return blocks[:, at : at + 2].contiguous().view(_F16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 32] uint8 from [n, 16] packed bytes: the low nibbles are elements 0..15, the high ones 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _high_bits(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """[n, 32] uint8: bit i of the little-endian uint32 at byte `at`, moved to bit 4 (the Q5 types' 5th bit)."""
    qh = blocks[:, at : at + 4].to(torch.int64)
    word = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)  # [n]
    shifts = torch.arange(32, dtype=torch.int64, device=blocks.device)
    return (((word[:, None] >> shifts) & 1) << 4).to(torch.uint8)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d f16, 16 bytes of nibbles; x = d * (q - 8)
    q = (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()
    return _halves(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d f16, m f16, 16 bytes of nibbles; x = d * q + m
    return _halves(b, 0) * _nibbles(b[:, 4:]).float() + _halves(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d f16, qh u32, 16 bytes of nibbles; x = d * (q - 16)
    q = ((_nibbles(b[:, 6:]) | _high_bits(b, 2)).to(torch.int8) - 16).float()
    return _halves(b, 0) * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d f16, m f16, qh u32, 16 bytes of nibbles; x = d * q + m
    q = (_nibbles(b[:, 8:]) | _high_bits(b, 4)).float()
    return _halves(b, 0) * q + _halves(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d f16, 32 int8; x = q * d
    return b[:, 2:].contiguous().view(torch.int8).float() * _halves(b, 0)


# type name -> (bytes per 32-element block, dequantizer over [n_blocks, bytes] uint8 -> [n_blocks, 32])
_BLOCKS: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q5_0": (22, _q5_0),
    "Q5_1": (24, _q5_1),
    "Q8_0": (34, _q8_0),
}
_CHUNK_BLOCKS = 1 << 16  # blocks dequantized at once (8 MiB of float32)
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
TORCH_TYPES = frozenset(_BLOCKS) | frozenset(_FLOATS)  # the type names dequantized in torch


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw`: the tensor's bytes (uint8, 1-d); returns a new float32 tensor of `shape` (never a view of `raw`)."""
    if type_name in _FLOATS:
        return raw.view(_FLOATS[type_name]).to(torch.float32, copy=True).reshape(shape)
    if type_name in _BLOCKS:
        size, fn = _BLOCKS[type_name]
        blocks = raw.view(-1, size)
        out = torch.empty(blocks.shape[0], 32)
        # A slice of blocks at a time into the result: whole, a 49k-row Q8_0 embedding's int8, float and product
        # temporaries would hold three times its float32 size at once (the CPU load's peak memory).
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            out[start : start + _CHUNK_BLOCKS] = fn(blocks[start : start + _CHUNK_BLOCKS])
        return out.reshape(shape)
    return dequantize_numpy(raw, type_name, shape)


def dequantize_numpy(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """`gguf.quants`' dequantization (every type it knows; the specification the torch forms match)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qtype = GGMLQuantizationType[type_name]
    rows = raw.numpy().reshape(-1, raw.numel() // max(1, _rows(shape)))  # one row of blocks per tensor row
    array = np.array(gguf_dequantize(rows, qtype), dtype=np.float32)  # a copy: never a view of the file
    return torch.from_numpy(array).reshape(shape)


def _rows(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[:-1]:
        n *= d
    return n
