"""Token embedding and the LM head that maps hidden states back to vocabulary logits.

Parameters are allocated uninitialised (every one is loaded from a checkpoint), so building a large model
costs no random-init time. A tied head reads the embedding's weight; it owns no parameter of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.param_dtype import empty_parameter


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = empty_parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [T] -> [T, hidden]


class LMHead(nn.Module):
    """Untied output projection [vocab, hidden], no bias."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = empty_parameter(vocab_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)  # [N, hidden] -> [N, vocab]
