"""`Eagle3Head`: an EAGLE-3 draft head's maths, under the tensor names vLLM and SGLang load.

One Llama decoder layer (`midlayer`) whose attention reads, side by side, the normed embedding of a token and
a normed hidden state ([T, 2 * hidden] into q/k/v), then the head's final norm and its LM head over a reduced
vocabulary (`draft_vocab_size` rows; `d2t[i]` is what draft id i adds to become a target id). The hidden
state is, for a first draft, `fc` of the target's hidden states at three layers side by side
(models/aux_hidden.py); for the drafts after it, the head's own pre-norm output at the position before.

`forward` returns both the normed state (its logits give the next draft) and the pre-norm one (the next
position's hidden input). The embedding is the caller's: the target's, unless the checkpoint has its own.
Only maths and the names; loading and checks are worker/eagle3_setup.py's, stepping worker/eagle3.py's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.attention.layer import KVCache
from asyncllm.layers.embedding import LMHead, VocabEmbedding
from asyncllm.layers.linear import Linear, PackedLinear, qkv_shards
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding, RotaryInputs
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.llama import LLAMA_FAMILY, LLAMA_WEIGHTS, LlamaAttention, LlamaMLP
from asyncllm.models.weights import load_packed_weights

# config.json's `architectures` an EAGLE-3 head is published under (the first vLLM's and SGLang's name).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
VOCAB_MAPS = ("d2t", "t2d")  # draft -> target id offsets; the target -> draft mask (unused when drafting)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: Llama's, its q/k/v projections reading [embedding, hidden] (2 * hidden wide)."""

    def __init__(
        self, arch: ModelArchConfig, backend: AttentionBackend, qkv_bias: bool, norm_before_residual: bool
    ) -> None:
        super().__init__()
        h = arch.hidden_size
        self.self_attn = LlamaAttention(arch, backend, qkv_bias, arch.attention_bias)
        self.self_attn.qkv_proj = PackedLinear(
            2 * h, qkv_shards(arch.num_heads, arch.num_kv_heads, arch.head_dim), bias=qkv_bias
        )
        self.mlp = LlamaMLP(arch, LLAMA_FAMILY)
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps)  # the embedding's
        self.hidden_norm = RMSNorm(h, arch.rms_norm_eps)  # the hidden state's
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps)
        # Where the residual branches off the hidden state: after its norm, or before it (the default).
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,  # [T, hidden]
        hidden: torch.Tensor,  # [T, hidden]
        rope: RotaryInputs,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before adding it), as a Llama layer's."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2 * hidden]
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,  # the head's (its vocab_size is the target's)
        backend: AttentionBackend,
        target_hidden_size: int,
        num_aux: int,  # target layers read side by side (3)
        draft_vocab_size: int,
        own_embedding: bool,  # the checkpoint has `embed_tokens.weight`; else the caller passes the target's
        qkv_bias: bool,
        norm_before_residual: bool,
    ) -> None:
        super().__init__()
        self.arch = arch
        h = arch.hidden_size
        self.fc = Linear(num_aux * target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(arch, backend, qkv_bias, norm_before_residual)
        self.norm = RMSNorm(h, arch.rms_norm_eps)
        self.lm_head = LMHead(draft_vocab_size, h)
        self.embed_tokens = VocabEmbedding(arch.vocab_size, h) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64), persistent=False)
        max_positions = max(arch.max_position_embeddings, arch.max_model_len)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, num_aux * target hidden] (the target's hidden states side by side) -> [T, hidden]."""
        return self.fc(aux)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, hidden]: each row's token, embedded
        hidden: torch.Tensor,  # [T, hidden]: `combine`d target states, or the head's pre-norm output before
        positions: torch.Tensor,  # [T] int64
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed [T, hidden]: the logits' input, pre-norm [T, hidden]: the next position's hidden input)."""
        rope = RotaryInputs(positions, self.rotary_emb)
        x, residual = self.midlayer(embeds, hidden, rope, kv_cache, meta)
        return self.norm(x, residual)

    def draft(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N] the greedy draft of each row, as target token ids."""
        ids = self.lm_head(normed).argmax(dim=-1)  # [N] draft ids
        return ids + self.d2t[ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head's tensors by their checkpoint names (`midlayer.self_attn.q_proj.weight`, ...), `d2t` among
        them; strict about unknown, duplicate and missing names (UnsupportedModelError). `t2d` is skipped."""
        maps: dict[str, torch.Tensor] = {}

        def pairs() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in VOCAB_MAPS:
                    maps[name] = tensor
                else:
                    yield name, tensor

        load_packed_weights(
            self, pairs(), LLAMA_WEIGHTS.packed, lambda name: name.endswith(LLAMA_WEIGHTS.ignored_suffixes)
        )
        if "d2t" in maps:
            self.d2t.copy_(maps["d2t"].to(torch.int64))
