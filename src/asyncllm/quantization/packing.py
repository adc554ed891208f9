"""Integer codes out of AWQ's and GPTQ's int32 words, in each format's own order (our layout's packing is
`pack_codes` in kernels/quant_matmul_ref.py).

AWQ (its GEMM layout) packs 8 four-bit codes along the output dim, in the order 0, 2, 4, 6, 1, 3, 5, 7: the
code in bits 4i..4i+3 of a word is column 8c + AWQ_ORDER[i]. GPTQ packs `32 // bits` codes in plain order,
lowest bits first: along the input dim for its weights, along the output dim for its zero points. Codes come
back unsigned, as int32. Knows no checkpoint names.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4i..4i+3 of a word hold column AWQ_ORDER[i] of its eight


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., W] int32 -> [..., W, 32 // bits]: each word's fields, lowest bits first, unsigned."""
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    return (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ's [R, C / 8] int32 -> [R, C] four-bit codes (qweight: R inputs, C outputs; qzeros: R groups)."""
    fields = _fields(words, 4)  # [R, C/8, 8]: field i is column AWQ_ORDER[i]
    order = torch.tensor(AWQ_ORDER, device=words.device)
    columns = torch.empty_like(fields)
    columns[..., order] = fields  # column AWQ_ORDER[i] <- field i
    return columns.reshape(words.shape[0], -1)


def gptq_unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight [R / P, C] -> [R, C]: row r is field r % P of word row r // P."""
    fields = _fields(words, bits)  # [R/P, C, P]
    return fields.permute(0, 2, 1).reshape(-1, words.shape[1])


def gptq_unpack_columns(words: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qzeros [R, C / P] -> [R, C]: column c is field c % P of word column c // P."""
    return _fields(words, bits).reshape(words.shape[0], -1)
