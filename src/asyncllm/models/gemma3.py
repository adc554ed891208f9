"""Gemma 3 text models (`Gemma3ForCausalLM`): Llama's attention and gated MLP, with Gemma's numerics.

What differs from Llama, each from transformers' modeling_gemma3: RMSNorms scale by (1 + w) in float32
(`GemmaRMSNorm`), four per layer (the attention's and the MLP's outputs are normed before their residual
adds); per-head q/k norms of that form; a GELU-tanh gate (GeGLU); embeddings times sqrt(hidden_size), rounded
to the weights' dtype; the softmax scale query_pre_attn_scalar ** -0.5; sliding-window layers interleaved with
global ones (`layer_types`), the sliding ones rotated with their own rope base (rope_local_base_freq), the
global ones with rope_theta and its scaling; the final-logit softcap when the config sets one. transformers'
Gemma 3 reads `attn_logit_softcapping` but never applies it, so neither does this model. Only maths and the
family's declaration; the checkpoint names are Llama's (plus the norms), and there is no GGUF form.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.attention.layer import KVCache
from asyncllm.layers.activation import GeluTanhAndMul
from asyncllm.layers.embedding import LMHead
from asyncllm.layers.norm import GemmaRMSNorm
from asyncllm.layers.rotary import RotaryEmbedding, RotaryInputs
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.family import EmbeddingScale, FamilySpec
from asyncllm.models.llama import LLAMA_WEIGHTS, LlamaMLP, LlamaModel, check_activation, lm_logits
from asyncllm.models.qwen3 import Qwen3Attention

GEMMA3_FAMILY = FamilySpec(
    weights=dataclasses.replace(LLAMA_WEIGHTS, gguf=None),
    norm=GemmaRMSNorm,
    activation=GeluTanhAndMul,
    hidden_act="gelu_pytorch_tanh",
    embedding_scale=EmbeddingScale.SQRT_HIDDEN,
)


class Gemma3Attention(Qwen3Attention):
    qk_norm = GemmaRMSNorm
    qk_unit_offset = True  # the fused kernel's form of its q/k norms: scale by (1 + w)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, self_attn: Gemma3Attention, family: FamilySpec) -> None:
        super().__init__()
        self.input_layernorm = family.norm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = family.norm(arch.hidden_size, arch.rms_norm_eps)
        self.pre_feedforward_layernorm = family.norm(arch.hidden_size, arch.rms_norm_eps)
        self.post_feedforward_layernorm = family.norm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch, family)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output, normed (the embedding for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it; None for layer 0
        rope: RotaryInputs,  # this layer's tables: local for a sliding layer, global otherwise
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's normed MLP output, the residual stream before adding it). Each residual add
        happens inside the next pre-norm (fused when enabled); the sums are transformers' exactly."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text decoder (the 1B checkpoint's architecture; larger ones' language model alike)."""

    family: ClassVar[FamilySpec] = GEMMA3_FAMILY

    def __init__(self, arch: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = arch
        family = self.family
        check_activation(arch, family)
        bias = arch.attention_bias
        layers = [
            Gemma3DecoderLayer(arch, Gemma3Attention(arch, attn_backend, bias, bias, arch.layer_window(i)), family)
            for i in range(arch.num_layers)
        ]
        self.model = LlamaModel(arch, layers, family)
        max_positions = max(arch.max_position_embeddings, arch.max_model_len)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        local_theta = arch.local_rope_theta
        self.rotary_emb_local = (
            None if local_theta is None else RotaryEmbedding(arch.head_dim, max_positions, local_theta, None)
        )
        self.lm_head = None if arch.tie_word_embeddings else LMHead(arch.vocab_size, arch.hidden_size)
        assert family.embedding_scale is EmbeddingScale.SQRT_HIDDEN, family.embedding_scale
        # A scalar rounded to the activations' dtype before multiplying, as transformers' Gemma does.
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size**0.5), persistent=False)
        self._sliding = tuple(arch.is_sliding(i) for i in range(arch.num_layers))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, every sequence's new tokens packed
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        assert len(kv_caches) == len(self.model.layers), (len(kv_caches), len(self.model.layers))
        x = self.model.embed_tokens(input_ids)
        x = x * self.embed_scale.to(x.dtype)
        # Looked up at most once each, shared by the layers of their kind.
        global_rope = RotaryInputs(positions, self.rotary_emb)
        local_rope = global_rope if self.rotary_emb_local is None else RotaryInputs(positions, self.rotary_emb_local)
        residual: torch.Tensor | None = None
        for layer, kv_cache, sliding in zip(self.model.layers, kv_caches, self._sliding):
            x, residual = layer(x, residual, local_rope if sliding else global_rope, kv_cache, meta)
        assert residual is not None
        out, _ = self.model.norm(x, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(hidden, self.lm_head, self.model.embed_tokens, self.arch.final_logit_softcapping)
