"""Switching a loaded quantized model to torch's CPU int4 kernel from outside (`QuantScheme.cpu_int4`): every
quantized linear layer packed (cpu_int4.py), and an LM head the checkpoint stored with 8 bits or fewer (a GGUF
file's Q8_0 or Q6_K `output` or tied `token_embd`) requantized to 8-bit codes per 32 inputs and packed too, as
`Int4Head`, the model's `lm_head` from then on. A tied embedding whose float table those 8-bit codes give back
exactly (a Q8_0 `token_embd`) is read from them too (`Int8Embedding`): its float32 table was the largest tensor
left in memory.

Decode on CPU reads every weight once a token; the head alone is a sixth of SmolLM2's weights. Knows no
checkpoint format: the head's stored type comes in the scheme.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from asyncllm.kernels.quant_matmul_ref import unpack_codes
from asyncllm.layers import host_heap
from asyncllm.layers.embedding import LMHead
from asyncllm.quantization import cpu_int4
from asyncllm.quantization.linear import QuantLinear
from asyncllm.quantization.scheme import QuantScheme

logger = logging.getLogger("asyncllm")

# Stored head types whose values an 8-bit code per 32 inputs holds (exactly for Q8_0: llama.cpp's own rule).
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
_HEAD_ROWS = 1024  # rows of the head requantized at once (a multiple of the kernel's 64-row tiles)


class Int4Head(nn.Module):
    """The LM head [vocab, hidden] in the kernel's form: logits = hidden W^T in the activations' dtype."""

    def __init__(self, weight: cpu_int4.Int4Weight) -> None:
        super().__init__()
        self.weight_int4 = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return cpu_int4.int4_linear(hidden, self.weight_int4, None)  # [N, hidden] -> [N, vocab]


class Int8Embedding(nn.Module):
    """Token embedding [vocab, hidden] as 8-bit codes and one float32 scale per 32 values: the looked-up rows are
    dequantized, code * scale, the values the float table held."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.codes = codes  # [V, K] int8
        self.scales = scales  # [V, K / 32] float32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[input_ids].float()  # [T, K]
        groups = rows.view(*rows.shape[:-1], self.scales.shape[-1], 32) * self.scales[input_ids][..., None]
        return groups.flatten(-2)  # [T, hidden]


def use_cpu_int4(model: nn.Module, scheme: QuantScheme, dtype: torch.dtype) -> dict[str, int]:
    """Pack the model's quantized layers (and its head, where `scheme.head_type` allows); returns the counts of
    layers packed, layers dequantized once instead (shapes the kernel cannot take) and heads packed."""
    counts = {"packed": 0, "dense": 0, "head": 0}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts["packed" if module.use_cpu_int4(dtype) else "dense"] += 1
    head = _head_weight(model)
    if head is not None and scheme.head_type is not None and scheme.head_type not in _FLOAT_TYPES:
        vocab, hidden = head.shape
        if cpu_int4.packable(vocab, hidden, 8, 32):
            tied = model.lm_head is None
            packed, table = _pack_head(head.detach(), keep_codes=tied)
            model.lm_head = Int4Head(packed)  # an untied head's float weight goes with the module it replaces
            counts["head"] = 1
            if table is not None:
                model.model.embed_tokens = table  # type: ignore[union-attr]
    logger.info(
        "CPU int4 kernel: %d linear layers packed, %d dequantized (shapes it cannot take), LM head %s",
        counts["packed"], counts["dense"], "packed" if counts["head"] else "in floats",
    )  # fmt: skip
    return counts


def _pack_head(weight: torch.Tensor, keep_codes: bool) -> tuple[cpu_int4.Int4Weight, Int8Embedding | None]:
    """The head requantized and packed a slice of rows at a time, each written into the whole's preallocated
    tensors: whole, or concatenated at the end, the temporaries of a 49k-row vocabulary would add the table again
    to the process's peak memory. With `keep_codes`, also the table as an `Int8Embedding` where its codes give
    every value back exactly (else None)."""
    vocab, hidden = weight.shape
    packed: cpu_int4.Int4Weight | None = None
    codes = torch.empty(vocab, hidden, dtype=torch.int8) if keep_codes else None
    scales = torch.empty(vocab, hidden // 32) if keep_codes else None
    exact = keep_codes
    for start in range(0, vocab, _HEAD_ROWS):
        rows = weight[start : start + _HEAD_ROWS]
        end = start + rows.shape[0]
        qweight, scale, qzeros = cpu_int4.requantize_int8(rows)
        part = cpu_int4.pack(qweight, scale, qzeros, None, bits=8, group_size=32)
        if packed is None:
            packed = cpu_int4.Int4Weight(
                part.packed.new_empty(vocab, part.packed.shape[1]),
                part.scale_zeros.new_empty(part.scale_zeros.shape[0], vocab, 2),
                part.group_size, part.planes, part.in_features, vocab,
            )  # fmt: skip
        packed.packed[start:end] = part.packed
        packed.scale_zeros[:, start:end] = part.scale_zeros
        if exact and codes is not None and scales is not None:
            code = (unpack_codes(qweight, 8) - 128).to(torch.int8)  # [rows, K]: the zero point is 128
            exact = torch.equal(code.view(rows.shape[0], -1, 32) * scale[..., None], rows.view(code.shape[0], -1, 32))
            codes[start:end], scales[start:end] = code, scale
            if exact:  # these rows live on in their codes: the float table's pages go now, not after the loop
                host_heap.release(rows)
            elif start:  # a slice the codes miss: the table stays, its released rows written back from their codes
                weight[:start] = Int8Embedding(codes[:start], scales[:start])(torch.arange(start))
    assert packed is not None
    table = Int8Embedding(codes, scales) if exact and codes is not None and scales is not None else None
    return packed, table


def _head_weight(model: nn.Module) -> torch.Tensor | None:
    """The LM head's float weight [vocab, hidden]: its own, or the embedding's when tied (lm_head None)."""
    if not hasattr(model, "lm_head"):
        return None
    head = model.lm_head
    if isinstance(head, LMHead):
        return head.weight
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(embed, "weight", None) if head is None else None
    return weight if isinstance(weight, torch.Tensor) else None
