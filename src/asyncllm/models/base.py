"""`CausalLM`: what the worker drives in every model family, and the one place a family's spec meets loading.

A family is one file: a `CausalLM` subclass (maths only) with its `FamilySpec`, plus one entry in
`models/registry.py`. Gemma 3 is `models/gemma3.py` (its decoder layer with four norms; its spec naming
a (1 + w) norm and a GELU-tanh activation, classes in `layers/`, and the embedding scale). A MoE family
(Qwen3-MoE) would be `models/qwen3_moe.py` reusing Llama's attention, its expert layer in `layers/moe.py` with
a grouped-GEMM kernel in `kernels/` beside its `*_ref.py`, and an experts `Split` in `models/family.py`.
Knows no file format, device or process group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.layer import KVCache
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.family import FamilySpec
from asyncllm.models.weights import load_planned_weights


class CausalLM(nn.Module, ABC):
    """A decoder-only model built at `arch` (one rank's shard of it under tensor parallelism)."""

    family: ClassVar[FamilySpec]
    arch: ModelArchConfig

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, every sequence's new tokens packed
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] (the whole vocabulary on every rank)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-named tensors through the family's weight plan; strict about unknown, duplicate and
        missing names."""
        load_planned_weights(self, weights, self.family.weights, tied=self.arch.tie_word_embeddings)
