"""The Llama family: LlamaForCausalLM, MistralForCausalLM (same maths) and Qwen2ForCausalLM (qkv bias).

Only maths, plus the family's declaration (`LLAMA_FAMILY`: its numerics and weight plan, the one place Llama's
checkpoint and GGUF names are written down). Every input (token ids, positions, this step's KV caches and
attention metadata) is passed to `forward`; the attention kernel is the backend handed to the constructor.
Module names mirror Hugging Face names except the packed `qkv_proj` and `gate_up_proj`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.attention.layer import Attention, KVCache
from asyncllm.errors import UnsupportedModelError
from asyncllm.kernels.decode_layer_ref import DecodeLayerWeights
from asyncllm.layers.activation import SiluAndMul
from asyncllm.layers.embedding import LMHead, VocabEmbedding
from asyncllm.layers.fusion import Fusable, LaunchesPdl
from asyncllm.layers.linear import Linear, PackedLinear, gate_up_shards, qkv_shards
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.prologue import PrologueKind, ProloguePair, act_linear, norm_linear
from asyncllm.layers.rotary import RotaryEmbedding, RotaryInputs, apply_rotary
from asyncllm.models.aux_hidden import AuxHidden
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.family import EmbeddingScale, FamilySpec, GGUFNames, Split, WeightPlan
from asyncllm.models.one_launch import OneLaunchDecoder, OneLaunchLayer, OneLaunchSpec

LLAMA_GGUF = GGUFNames(
    globals={"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
    blocks={
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    layers="model.layers",
)
LLAMA_WEIGHTS = WeightPlan(
    packed={
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    },
    column_parallel={
        "q_proj": Split.QUERY_HEADS,
        "k_proj": Split.KV_HEADS,
        "v_proj": Split.KV_HEADS,
        "gate_proj": Split.INTERMEDIATE,
        "up_proj": Split.INTERMEDIATE,
    },
    row_parallel={"o_proj": Split.QUERY_HEADS, "down_proj": Split.INTERMEDIATE},
    embedding="model.embed_tokens",
    lm_head="lm_head",
    gguf=LLAMA_GGUF,
    ignored_suffixes=("rotary_emb.inv_freq",),  # old checkpoints carry RoPE buffers
)
LLAMA_FAMILY = FamilySpec(weights=LLAMA_WEIGHTS)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, family: FamilySpec) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = PackedLinear(arch.hidden_size, gate_up_shards(inter), bias=arch.mlp_bias)
        self.down_proj = Linear(inter, arch.hidden_size, bias=arch.mlp_bias)
        self.act = family.activation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))  # [T, hidden] -> [T, 2I] -> [T, hidden]

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        return act_linear(self.act, self.down_proj, gate_up)  # [T, 2I] -> [T, I] -> [T, hidden]


class LlamaAttention(nn.Module, Fusable, LaunchesPdl):
    qk_unit_offset: ClassVar[bool] = False  # the q/k norms' form in the fused kernel: Gemma's scales by (1 + w)

    def __init__(
        self,
        arch: ModelArchConfig,
        backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
        window: int | None = None,  # this layer's sliding window (arch.layer_window); None: global attention
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        shards = qkv_shards(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.qkv_proj = PackedLinear(arch.hidden_size, shards, bias=qkv_bias)
        self.o_proj = Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=o_bias)
        scale = None if arch.query_pre_attn_scalar is None else arch.query_pre_attn_scalar**-0.5
        self.attn = Attention(arch.num_heads, arch.num_kv_heads, arch.head_dim, backend, scale, window)
        self.rms_norm_eps = arch.rms_norm_eps
        self._fused_qkv: Callable[..., torch.Tensor] | None = None  # q/k norm + rotary + KV write, one kernel
        self._pdl = False  # that kernel's launches programmatic dependents (use_pdl)

    @property
    def fused(self) -> bool:
        return self._fused_qkv is not None

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.qk_norm_rope_kv import qk_norm_rope_kv

        self._fused_qkv = qk_norm_rope_kv

    def use_pdl(self, on: bool) -> None:
        self._pdl = on

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for families that normalise q/k per head before rotary (Qwen3); identity here."""
        return q, k

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-head q/k RMSNorm weights the fused kernel applies (Qwen3); none here."""
        return None, None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: RotaryInputs,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), rope, kv_cache, meta)

    def attend(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D]: qkv_proj's output
        rope: RotaryInputs,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self._fused_qkv is not None:
            k_cache, v_cache = kv_cache
            q_norm, k_norm = self.qk_norm_weights()
            q = self._fused_qkv(
                qkv,
                rope.positions,
                rope.cos_cache,
                rope.sin_cache,
                k_cache,
                v_cache,
                meta.slot_mapping,
                q_norm,
                k_norm,
                eps=self.rms_norm_eps,
                unit_offset=self.qk_unit_offset,
                k_scale=self.attn.k_scale,
                v_scale=self.attn.v_scale,
                pdl=self._pdl,
            )  # [T, H, D]; this step's k/v are in the cache now
            return self.o_proj(self.attn.attend_cached(q, kv_cache, meta))
        num_tokens = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.normalize_qk(q, k)
        cos, sin = rope.lookup()
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaDecoderLayer(nn.Module, OneLaunchLayer):
    def __init__(
        self, arch: ModelArchConfig, self_attn: LlamaAttention, family: FamilySpec, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = family.norm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = family.norm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch, family) if mlp is None else mlp  # [T, hidden] -> [T, hidden]
        self._one_launch: OneLaunchDecoder | None = None  # small decode steps in one launch (models/one_launch.py)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (the embedding for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it; None for layer 0
        rope: RotaryInputs,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it). Each residual add happens
        inside the next norm (fused in one kernel when enabled); the sums are transformers' exactly. Each norm
        feeds one projection (`norm_linear`: one launch at batch-1 decode where the pair is on); or the whole
        layer is one launch, for the small decode steps its `OneLaunchDecoder` takes."""
        if self._one_launch is not None and (out := self._one_launch(x, residual, rope, kv_cache, meta)) is not None:
            return out
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        x = self.self_attn.attend(qkv, rope, kv_cache, meta)
        if isinstance(self.mlp, LlamaMLP):
            gate_up, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, x, residual)
            return self.mlp.down(gate_up), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def use_one_launch(self, decoder: OneLaunchDecoder | None) -> None:
        self._one_launch = decoder

    def one_launch_spec(self) -> OneLaunchSpec | None:
        """The kernel's maths is this layer's where every projection is a plain dense layer without bias in the
        [out, in] layout, the norms transformers' RMSNorm (Qwen3's q/k norms too, or none), the activation
        SiLU-and-mul, the attention global and on the Triton backend's fused q/k kernel."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP) or type(mlp.act) is not SiluAndMul or not attn.fused:
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        kinds = (PackedLinear, Linear, PackedLinear, Linear)
        if any(type(m) is not kind or m.bias is not None for m, kind in zip(linears, kinds)):
            return None
        weights = [m.weight for m in linears]
        norms = [self.input_layernorm, self.post_attention_layernorm]
        q_norm, k_norm = attn.qk_norm_weights()
        if q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]  # type: ignore[list-item]  (Qwen3's, when it has them)
        dtype = weights[0].dtype
        eps = self.input_layernorm.eps  # the kernel's one epsilon, for every norm
        if any(type(n) is not RMSNorm or n.weight.dtype != dtype or n.eps != eps for n in norms) or attn.qk_unit_offset:
            return None
        if attn.attn.window is not None or any(w.dtype != dtype or not w.is_contiguous() for w in weights):
            return None
        qkv, o, gate_up, down = weights
        layer = DecodeLayerWeights(
            self.input_layernorm.weight, qkv, q_norm, k_norm, o, self.post_attention_layernorm.weight, gate_up, down,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, eps,
        )  # fmt: skip
        return OneLaunchSpec(layer, attn.attn.scale)

    def prologue_pairs(self) -> list[ProloguePair]:
        pairs = [ProloguePair(PrologueKind.RMS_NORM, self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, LlamaMLP):
            pairs.append(ProloguePair(PrologueKind.RMS_NORM, self.post_attention_layernorm, self.mlp.gate_up_proj))
            pairs.append(ProloguePair(PrologueKind.SILU_MUL, self.mlp.act, self.mlp.down_proj))
        return pairs


class LlamaModel(nn.Module):
    """The embedding, the decoder layers (any family's) and the final norm, under the checkpoints' names."""

    def __init__(self, arch: ModelArchConfig, layers: Sequence[nn.Module], family: FamilySpec) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = family.norm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Decoder-only transformer with RoPE, GQA, RMSNorm and a SiLU-gated MLP."""

    family: ClassVar[FamilySpec] = LLAMA_FAMILY
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, arch: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.arch = arch
        family = self.family
        check_activation(arch, family)
        qkv_bias = arch.attention_bias if family.qkv_bias is None else family.qkv_bias
        o_bias = arch.attention_bias if family.o_bias is None else family.o_bias
        layers = [
            LlamaDecoderLayer(
                arch,
                self.attention_cls(arch, attn_backend, qkv_bias, o_bias, window=arch.layer_window(i)),
                family,
                self.layer_mlp(arch, i),
            )
            for i in range(arch.num_layers)
        ]
        self.model = LlamaModel(arch, layers, family)
        max_positions = max(arch.max_position_embeddings, arch.max_model_len)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.lm_head = None if arch.tie_word_embeddings else LMHead(arch.vocab_size, arch.hidden_size)
        if family.embedding_scale is EmbeddingScale.SQRT_HIDDEN:
            # A scalar rounded to the activations' dtype before multiplying, as transformers' Gemma does.
            self.register_buffer("embed_scale", torch.tensor(arch.hidden_size**0.5), persistent=False)
        else:
            self.embed_scale: torch.Tensor | None = None  # a plain attribute: embeddings used as they are
        # A CPU decode step in few ops (models/cpu_decode.py), set from outside once loaded; None where it passes.
        self.cpu_decode: Callable[..., torch.Tensor | None] | None = None
        # The hidden states an EAGLE-3 head reads (models/aux_hidden.py), set from outside; None: none copied.
        self.aux_hidden: AuxHidden | None = None

    def layer_mlp(self, arch: ModelArchConfig, layer: int) -> nn.Module | None:
        """Layer `layer`'s feed-forward block; None: the family's gated MLP (a MoE family returns its experts)."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, every sequence's new tokens packed
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], final-normed
        assert len(kv_caches) == len(self.model.layers), (len(kv_caches), len(self.model.layers))
        decode, aux = self.cpu_decode, self.aux_hidden
        if decode is not None and aux is None and (hidden := decode(input_ids, positions, kv_caches, meta)) is not None:
            return hidden
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        rope = RotaryInputs(positions, self.rotary_emb)  # looked up at most once, shared by every layer
        residual: torch.Tensor | None = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if aux is not None:
                aux.capture(i, x, residual)
            x, residual = layer(x, residual, rope, kv_cache, meta)
        assert residual is not None
        if aux is not None:
            aux.capture(len(self.model.layers), x, residual)
        out, _ = self.model.norm(x, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(hidden, self.lm_head, self.model.embed_tokens, self.arch.final_logit_softcapping)


def lm_logits(hidden: torch.Tensor, lm_head: nn.Module | None, embed: nn.Module, cap: float | None) -> torch.Tensor:
    """[N, hidden] -> [N, vocab] through the LM head or, when tied (`lm_head` None), the embedding matrix;
    then the config's final-logit softcap, when it has one: cap * tanh(logits / cap)."""
    if lm_head is None:
        weight = embed.weight
        assert isinstance(weight, torch.Tensor)
        logits = torch.nn.functional.linear(hidden, weight)
    else:
        logits = lm_head(hidden)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def check_activation(arch: ModelArchConfig, family: FamilySpec) -> None:
    """The config's MLP activation must be the one the family computes."""
    if arch.hidden_act != family.hidden_act:
        raise UnsupportedModelError(
            f"{arch.architecture} computes hidden_act={family.hidden_act!r}, but the config asks for "
            f"{arch.hidden_act!r}: not a variant asyncllm supports"
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's maths; its sliding window (every layer's, when configured) is its attention's."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with a bias on q/k/v (never on o), whatever `attention_bias` says."""

    family = dataclasses.replace(LLAMA_FAMILY, qkv_bias=True, o_bias=False)
