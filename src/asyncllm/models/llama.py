"""The Llama family: LlamaForCausalLM, MistralForCausalLM (same maths) and Qwen2ForCausalLM (qkv bias).

Only maths: every input (token ids, positions, this step's KV caches and attention metadata) is passed to
`forward`; the attention kernel is the backend handed to the constructor. Module names mirror Hugging Face
names except the packed `qkv_proj` and `gate_up_proj`, so loading is a short, strict name mapping.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.attention.layer import Attention, KVCache
from asyncllm.layers.activation import SiluAndMul
from asyncllm.layers.embedding import LMHead, VocabEmbedding
from asyncllm.layers.linear import Linear, PackedLinear, gate_up_shards, qkv_shards
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding, apply_rotary
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.weights import LLAMA_PACKED, load_packed_weights


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = PackedLinear(arch.hidden_size, gate_up_shards(inter), bias=arch.mlp_bias)
        self.down_proj = Linear(inter, arch.hidden_size, bias=arch.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # [T, hidden] -> [T, 2I] -> [T, I] -> [T, hidden]


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        shards = qkv_shards(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.qkv_proj = PackedLinear(arch.hidden_size, shards, bias=qkv_bias)
        self.o_proj = Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=o_bias)
        self.attn = Attention(arch.num_heads, arch.num_kv_heads, arch.head_dim, backend)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for families that normalise q/k per head before rotary (Qwen3); identity here."""
        return q, k

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim / 2]
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.normalize_qk(q, k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, self_attn: LlamaAttention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Un-fused residual adds, in transformers' order, keep fp32 results identical to it.
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, layers: list[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer with RoPE, GQA, RMSNorm and a SiLU-gated MLP."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, arch: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = arch
        qkv_bias, o_bias = self.attention_biases(arch)
        layers = [
            LlamaDecoderLayer(arch, self.attention_cls(arch, attn_backend, qkv_bias, o_bias))
            for _ in range(arch.num_layers)
        ]
        self.model = LlamaModel(arch, layers)
        max_positions = max(arch.max_position_embeddings, arch.max_model_len)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.lm_head = None if arch.tie_word_embeddings else LMHead(arch.vocab_size, arch.hidden_size)

    @classmethod
    def attention_biases(cls, arch: ModelArchConfig) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o): Llama/Mistral/Qwen3 follow `attention_bias` for all four."""
        return arch.attention_bias, arch.attention_bias

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, every sequence's new tokens packed
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        assert len(kv_caches) == len(self.model.layers), (len(kv_caches), len(self.model.layers))
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)  # looked up once, shared by every layer
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, meta)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] through the LM head or, when tied, the embedding matrix."""
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; strict about unknown, duplicate and missing names."""
        tied = self.arch.tie_word_embeddings

        def skip(name: str) -> bool:
            # Old checkpoints carry RoPE inv_freq buffers; tied ones may still store a copy of lm_head.
            return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")

        load_packed_weights(self, weights, LLAMA_PACKED, skip)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's maths; its sliding window is vetted (and refused if effective) by the config."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with a bias on q/k/v (never on o), whatever `attention_bias` says."""

    @classmethod
    def attention_biases(cls, arch: ModelArchConfig) -> tuple[bool, bool]:
        return True, False
