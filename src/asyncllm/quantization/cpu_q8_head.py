"""The LM head on CPU from the tied embedding's 8-bit codes (`Int8Embedding`, a GGUF Q8_0 `token_embd`), through
the compiled `asl_q8_head` (kernels/cpu_decode_ops.c): the hidden rows quantized to 8 bits per 32 values and each
group's dot product summed in integers, as llama.cpp reads a Q8_0 head. It replaces the packed `Int4Head`, whose
two 4-bit planes held the same codes a second time (35 MB for SmolLM2) and read them slower on one thread.

Installed from outside (`use_q8_head`) where the C ops built and the engine computes on one CPU thread: on more,
torch's int4 kernel splits the head among its threads and stays faster (measured: bench/RESULTS.md), so
`Int4Head` stays, and it is the twin (ASYNCLLM_CPU_NATIVE=off).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from asyncllm.kernels.cpu_decode_native import CpuDecodeOps
from asyncllm.quantization.cpu_pack import Int4Head, Int8Embedding


class Q8Head(nn.Module):
    """logits [N, vocab] float32 of hidden [N, hidden] against the embedding's codes [vocab, hidden]."""

    def __init__(self, table: Int8Embedding, ops: CpuDecodeOps) -> None:
        super().__init__()
        self.codes, self.scales = table.codes, table.scales  # the embedding's own tensors: nothing copied
        self.ops = ops

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.q8_head(self.codes, self.scales, hidden.float().contiguous())


def use_q8_head(model: nn.Module, ops_for: Callable[[], CpuDecodeOps | None]) -> bool:
    """Swap a packed `Int4Head` tied to an `Int8Embedding` for `Q8Head` (its planes freed) on a one-thread
    engine, where `ops_for` (called only then) gives the compiled ops; whether it did."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if torch.get_num_threads() != 1:
        return False
    if not isinstance(getattr(model, "lm_head", None), Int4Head) or not isinstance(embed, Int8Embedding):
        return False
    if embed.codes.shape[1] % 32 or not embed.codes.is_contiguous() or not embed.scales.is_contiguous():
        return False
    ops = ops_for()
    if ops is None:
        return False
    model.lm_head = Q8Head(embed, ops)
    return True
