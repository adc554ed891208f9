"""`CausalLM`: what the worker drives in every model family, and the one place a family's spec meets loading;
`EncoderModel`: the same for a bidirectional encoder family (BERT), whose forward takes no KV cache.

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
from asyncllm.attention.varlen import EncoderBatch
from asyncllm.errors import UnsupportedModelError
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


class EncoderModel(nn.Module, ABC):
    """A bidirectional encoder built at `arch` (`arch.encoder` set), whole: no KV cache, no tensor parallelism.

    The seam an engine calls (its families document their own numerics):
    - `forward(input_ids [T], positions [T], token_type_ids [T], batch)`: every sequence packed as `batch`
      says, positions absolute from 0 in each sequence, token types 0 / 1 (sentence A / B); returns every
      token's final hidden state [T, hidden] (what mean / CLS / last-token pooling reads).
    - `classify(rows [B, hidden]) -> [B, num_labels]`, where `classifies`: the head applied to rows the caller
      picked from `forward`'s output (BERT's: each sequence's first token, [CLS], `batch.first_rows_cpu`).
    - `load_weights(pairs)`: checkpoint-named tensors, strict about unknown, duplicate and missing names.
    Inputs are the caller's to bound: ids below vocab_size, positions below max_position_embeddings, token
    types below type_vocab_size (out-of-range rows fault on a device rather than raise).
    """

    family: ClassVar[FamilySpec]
    classifies: ClassVar[bool] = False  # whether `classify` exists (a *ForSequenceClassification head)
    arch: ModelArchConfig

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, every sequence's tokens packed
        positions: torch.Tensor,  # [T] int64, 0 .. len - 1 within each sequence
        token_type_ids: torch.Tensor,  # [T] int64
        batch: EncoderBatch,
    ) -> torch.Tensor:  # [T, hidden]
        ...

    @property
    def num_labels(self) -> int | None:
        """The classifier's outputs; None where the model does not classify."""
        return None

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, hidden] rows of `forward`'s output -> [B, num_labels] logits."""
        raise UnsupportedModelError(f"{type(self).__name__} has no classification head: it embeds, it does not score")

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-named tensors; an unknown, duplicate or missing name is an UnsupportedModelError."""
