"""BERT, the encoder family: `BertModel` (every token's final hidden state, what an embedding model pools:
all-MiniLM-L6-v2, bge, e5) and `BertForSequenceClassification` (a cross-encoder: tanh pooler on the [CLS]
row, then the classifier).

transformers' maths op for op: word + token-type + absolute position embeddings, LayerNorm; per layer
bidirectional attention (q/k/v packed into one matmul), then dense + residual + LayerNorm (post-LN), a GELU MLP
(the exact erf form, or tanh where the config's hidden_act says), dense + residual + LayerNorm. The attention
is attention/varlen.py's layer: its torch twin, or its Triton kernel once the fused kernels are on.

The seam an engine calls (`EncoderModel`, models/base.py), the same for both classes:
- `forward(input_ids [T], positions [T], token_type_ids [T], batch: EncoderBatch) -> [T, hidden]`;
  positions absolute, 0 .. len - 1 in each sequence (the caller makes them).
- `classify(rows [B, hidden]) -> [B, num_labels]` (classifier only): the caller picks the rows, each
  sequence's [CLS] (first) token: `hidden[batch.first_rows_cpu]`.
- `load_weights(pairs)`: names as transformers saves them, with the `bert.` prefix
  (BertForSequenceClassification) or without (a BertModel, sentence-transformers' form).
Module names mirror transformers' except the packed `qkv_proj`. Knows no engine, file format or device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from asyncllm.attention.varlen import EncoderBatch, VarlenAttention
from asyncllm.errors import UnsupportedModelError
from asyncllm.layers.embedding import VocabEmbedding
from asyncllm.layers.linear import Linear, PackedLinear, qkv_shards
from asyncllm.layers.norm import LayerNorm
from asyncllm.models.base import EncoderModel
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.encoder_config import ENCODER_ACTIVATIONS, EncoderArch
from asyncllm.models.family import FamilySpec, WeightPlan
from asyncllm.models.weights import load_packed_weights

BERT_WEIGHTS = WeightPlan(
    packed={"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")},
    column_parallel={},  # no tensor parallelism: small models, and "dense" names three different splits
    row_parallel={},
    embedding="embeddings.word_embeddings",
    lm_head="",  # no LM head
    # Buffers older transformers saved with the weights (position and token-type id ranges): they carry nothing.
    ignored_suffixes=("embeddings.position_ids", "embeddings.token_type_ids"),
)
# Only the weight plan and the norm are read; the GELU form comes from the config (ENCODER_ACTIVATIONS).
BERT_FAMILY = FamilySpec(weights=BERT_WEIGHTS, norm=LayerNorm, hidden_act="gelu")
_PREFIX = "bert."
# TF-era checkpoints name a LayerNorm's parameters gamma / beta (transformers renames them on load too).
_LEGACY_NORM = {".LayerNorm.gamma": ".LayerNorm.weight", ".LayerNorm.beta": ".LayerNorm.bias"}


def encoder_arch(arch: ModelArchConfig) -> EncoderArch:
    if arch.encoder is None:
        raise UnsupportedModelError(f"{arch.architecture} needs an encoder config (BERT's fields); got a decoder's")
    return arch.encoder


class BertEmbeddings(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        enc = encoder_arch(arch)
        self.word_embeddings = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        self.position_embeddings = VocabEmbedding(arch.max_position_embeddings, arch.hidden_size)
        self.token_type_embeddings = VocabEmbedding(enc.type_vocab_size, arch.hidden_size)
        self.LayerNorm = LayerNorm(arch.hidden_size, enc.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        # transformers' order of the sums: (word + token type) + position
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)  # [T, hidden]
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = arch.num_heads, arch.head_dim
        self.qkv_proj = PackedLinear(arch.hidden_size, qkv_shards(arch.num_heads, arch.num_heads, arch.head_dim), True)
        self.attn = VarlenAttention(arch.num_heads, arch.num_heads, arch.head_dim, causal=False)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, 3 * H * D]
        q, k, v = (t.view(x.shape[0], self.num_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        return self.attn(q, k, v, batch)  # [T, H * D]


class BertAddNorm(nn.Module):
    """LayerNorm(dense(x) + residual): transformers' BertSelfOutput and BertOutput."""

    def __init__(self, in_features: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden_size, bias=True)
        self.LayerNorm = LayerNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        # `self` is transformers' name for this submodule (attention.self.query ...): checkpoints load by path.
        self.self = BertSelfAttention(arch)
        self.output = BertAddNorm(arch.num_heads * arch.head_dim, arch.hidden_size, encoder_arch(arch).layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class BertIntermediate(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        if arch.hidden_act not in ENCODER_ACTIVATIONS:
            raise UnsupportedModelError(
                f"{arch.architecture} computes hidden_act in {sorted(ENCODER_ACTIVATIONS)}; the config asks for "
                f"{arch.hidden_act!r}"
            )
        self.dense = Linear(arch.hidden_size, arch.intermediate_size, bias=True)
        self.act = nn.GELU(approximate=ENCODER_ACTIVATIONS[arch.hidden_act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))  # [T, hidden] -> [T, I]


class BertLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.attention = BertAttention(arch)
        self.intermediate = BertIntermediate(arch)
        self.output = BertAddNorm(arch.intermediate_size, arch.hidden_size, encoder_arch(arch).layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(arch) for _ in range(arch.num_layers))


class BertModel(EncoderModel):
    """The encoder alone: every token's final hidden state. A checkpoint's pooler, when it has one, is not
    loaded: embedding models pool the token states themselves (sentence-transformers' Pooling)."""

    family: ClassVar[FamilySpec] = BERT_FAMILY

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.arch = arch
        if arch.num_kv_heads != arch.num_heads:
            raise UnsupportedModelError(
                f"{arch.architecture} has one KV head per query head; the config says otherwise"
            )
        self.embeddings = BertEmbeddings(arch)
        self.encoder = BertEncoder(arch)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, absolute within each sequence
        token_type_ids: torch.Tensor,  # [T] int64
        batch: EncoderBatch,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, self._renamed(weights), BERT_WEIGHTS.packed, self._skips)

    def _skips(self, name: str) -> bool:
        return name.endswith(BERT_WEIGHTS.ignored_suffixes) or name.startswith("pooler.")

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names without the `bert.` prefix, legacy LayerNorm names in today's form."""
        for name, tensor in weights:
            name = name.removeprefix(_PREFIX)
            for old, new in _LEGACY_NORM.items():
                if name.endswith(old):
                    name = name[: -len(old)] + new
            yield name, tensor


class BertPooler(nn.Module):
    """tanh(dense(x)) of each sequence's [CLS] row."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size, bias=True)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(rows))


class BertForSequenceClassification(BertModel):
    """BertModel plus the pooler and a linear classifier of `num_labels` outputs (a cross-encoder's relevance
    logit when 1). Its checkpoint's pooler is required."""

    classifies = True

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__(arch)
        self.pooler = BertPooler(arch.hidden_size)
        self.classifier = Linear(arch.hidden_size, encoder_arch(arch).num_labels, bias=True)

    @property
    def num_labels(self) -> int:
        return encoder_arch(self.arch).num_labels

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, hidden] [CLS] rows of `forward`'s output -> [B, num_labels] logits."""
        return self.classifier(self.pooler(rows))

    def _skips(self, name: str) -> bool:
        return name.endswith(BERT_WEIGHTS.ignored_suffixes)
