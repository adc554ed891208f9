"""`CausalLM`: what the worker needs of a loaded model, whichever family built it.

A forward pass from the step's inputs to the final hidden states, and the LM head that turns chosen rows of
them into logits. Typing only: the worker calls the model through it and knows nothing of its layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.layer import KVCache
from asyncllm.models.config import ModelArchConfig


class CausalLM(Protocol):
    @property
    def arch(self) -> ModelArchConfig: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
