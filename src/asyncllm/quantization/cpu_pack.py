"""Switching a loaded quantized model to torch's CPU int4 kernel from outside (`QuantScheme.cpu_int4`): every
quantized linear layer packed (cpu_int4.py), and an LM head the checkpoint stored with 8 bits or fewer (a GGUF
file's Q8_0 or Q6_K `output` or tied `token_embd`) requantized to 8-bit codes per 32 inputs and packed too, as
`Int4Head`, the model's `lm_head` from then on (a tied embedding keeps its float table for the lookups).

Decode on CPU reads every weight once a token; the head alone is a sixth of SmolLM2's weights. Knows no
checkpoint format: the head's stored type comes in the scheme.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from asyncllm.layers.embedding import LMHead
from asyncllm.quantization import cpu_int4
from asyncllm.quantization.linear import QuantLinear
from asyncllm.quantization.scheme import QuantScheme

logger = logging.getLogger("asyncllm")

# Stored head types whose values an 8-bit code per 32 inputs holds (exactly for Q8_0: llama.cpp's own rule).
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
_HEAD_ROWS = 4096  # rows of the head requantized at once (a multiple of the kernel's 64-row tiles)


class Int4Head(nn.Module):
    """The LM head [vocab, hidden] in the kernel's form: logits = hidden W^T in the activations' dtype."""

    def __init__(self, weight: cpu_int4.Int4Weight) -> None:
        super().__init__()
        self.weight_int4 = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return cpu_int4.int4_linear(hidden, self.weight_int4, None)  # [N, hidden] -> [N, vocab]


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
            model.lm_head = Int4Head(
                _pack_head(head.detach())
            )  # an untied head's float weight goes with the module it replaces
            counts["head"] = 1
    logger.info(
        "CPU int4 kernel: %d linear layers packed, %d dequantized (shapes it cannot take), LM head %s",
        counts["packed"], counts["dense"], "packed" if counts["head"] else "in floats",
    )  # fmt: skip
    return counts


def _pack_head(weight: torch.Tensor) -> cpu_int4.Int4Weight:
    """The head requantized and packed a slice of rows at a time: whole, the int32/int64 temporaries of a
    49k-row vocabulary would add several times the table to the process's peak memory."""
    parts = []
    for start in range(0, weight.shape[0], _HEAD_ROWS):
        rows = weight[start : start + _HEAD_ROWS]
        qweight, scales, qzeros = cpu_int4.requantize_int8(rows)
        parts.append(cpu_int4.pack(qweight, scales, qzeros, None, bits=8, group_size=32))
    first = parts[0]
    return cpu_int4.Int4Weight(
        torch.cat([p.packed for p in parts]), torch.cat([p.scale_zeros for p in parts], dim=1),
        first.group_size, first.planes, first.in_features, weight.shape[0],
    )  # fmt: skip


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
