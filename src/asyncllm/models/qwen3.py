"""Qwen3: Llama's maths plus a per-head RMSNorm on queries and keys before rotary embeddings.

Only maths and the family's declaration (Llama's, plus the GGUF names of the q/k norms); everything else
(loading, forward signature, logits) is inherited from the Llama family.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.layers.norm import RMSNorm
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.llama import LLAMA_FAMILY, LLAMA_GGUF, LLAMA_WEIGHTS, LlamaAttention, LlamaForCausalLM

QWEN3_GGUF = LLAMA_GGUF.extended(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
QWEN3_FAMILY = dataclasses.replace(LLAMA_FAMILY, weights=dataclasses.replace(LLAMA_WEIGHTS, gguf=QWEN3_GGUF))


class Qwen3Attention(LlamaAttention):
    """Llama's attention with a per-head RMSNorm of queries and keys before rotary (Gemma 3's in its form)."""

    qk_norm: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
        window: int | None = None,
    ) -> None:
        super().__init__(arch, backend, qkv_bias, o_bias, window)
        self.q_norm = self.qk_norm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = self.qk_norm(arch.head_dim, arch.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # over head_dim of [T, H, D] / [T, Hkv, D]

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.q_norm.weight, self.k_norm.weight


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = QWEN3_FAMILY
    attention_cls = Qwen3Attention
