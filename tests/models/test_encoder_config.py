"""BERT configs through `ModelArchConfig.from_hf`: the encoder's fields read, what its maths does not compute
refused by name, and decoder configs untouched (no `encoder`, their activations only)."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from asyncllm.errors import UnsupportedModelError
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.encoder_config import is_encoder_config


def _bert(**overrides: Any) -> transformers.BertConfig:
    fields: dict[str, Any] = dict(
        architectures=["BertModel"],
        vocab_size=100,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        layer_norm_eps=1e-12,
    )
    return transformers.BertConfig(**{**fields, **overrides})


def test_minilm_shape_is_read() -> None:
    """all-MiniLM-L6-v2's shape: head_dim 32, one KV head per query head, LayerNorm eps as the norms' eps."""
    arch = ModelArchConfig.from_hf(_bert(), None)
    assert arch.encoder is not None
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (12, 12, 32)
    assert arch.hidden_act == "gelu" and arch.rms_norm_eps == arch.encoder.layer_norm_eps == 1e-12
    assert arch.encoder.type_vocab_size == 2 and arch.max_model_len == 512


def test_num_labels_comes_from_id2label() -> None:
    cross = _bert(architectures=["BertForSequenceClassification"], num_labels=1)
    assert ModelArchConfig.from_hf(cross, None).encoder.num_labels == 1  # type: ignore[union-attr]
    three = _bert(architectures=["BertForSequenceClassification"], id2label={0: "a", 1: "b", 2: "c"})
    assert ModelArchConfig.from_hf(three, None).encoder.num_labels == 3  # type: ignore[union-attr]


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "gelu_pytorch_tanh"])
def test_gelu_forms_are_accepted(act: str) -> None:
    assert ModelArchConfig.from_hf(_bert(hidden_act=act), None).hidden_act == act


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
        (dict(position_embedding_type="relative_key_query"), "position_embedding_type='relative_key_query'"),
        (dict(is_decoder=True), "is_decoder=True"),
        (dict(hidden_act="relu"), "hidden_act='relu' is not supported; supported: 'gelu'"),
        (dict(type_vocab_size=0), "type_vocab_size=0"),
    ],
)
def test_what_the_maths_does_not_compute_is_refused(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        ModelArchConfig.from_hf(_bert(**overrides), None)


def test_absolute_positions_bound_the_model_length() -> None:
    with pytest.raises(Exception, match="max_model_len=1024 exceeds the model's max_position_embeddings"):
        ModelArchConfig.from_hf(_bert(), 1024)
    assert ModelArchConfig.from_hf(_bert(), 128).max_model_len == 128


def test_decoders_are_not_encoders() -> None:
    llama = transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, vocab_size=100,
    )  # fmt: skip
    assert not is_encoder_config(llama) and ModelArchConfig.from_hf(llama, None).encoder is None
    llama.hidden_act = "gelu"  # an encoder's activation is still refused for a decoder
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu' is not supported"):
        ModelArchConfig.from_hf(llama, None)
