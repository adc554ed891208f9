"""ModelArchConfig.from_hf: every config spelling read the same way, unsupported features refused clearly."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import transformers

from asyncllm.errors import UnsupportedModelError
from asyncllm.models.config import LinearRopeScaling, Llama3RopeScaling, ModelArchConfig

_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=100,
)
_LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def _llama(**kw: Any) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **{**_SHAPE, **kw})


def test_shape_fields_and_head_dim_default() -> None:
    arch = ModelArchConfig.from_hf(_llama(rms_norm_eps=1e-5), max_model_len=None)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (64, 2, 4, 2)
    assert arch.head_dim == 16 and arch.num_kv_groups == 2
    assert arch.max_model_len == arch.max_position_embeddings == 512
    assert arch.rms_norm_eps == 1e-5 and arch.rope_theta == 10000.0 and arch.rope_scaling is None
    assert ModelArchConfig.from_hf(_llama(head_dim=24), 100).head_dim == 24
    assert ModelArchConfig.from_hf(_llama(), 100).max_model_len == 100


def test_rope_parameters_transformers5_spelling() -> None:
    cfg = _llama(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **_LLAMA3))
    arch = ModelArchConfig.from_hf(cfg, None)
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)


def test_rope_theta_and_rope_scaling_older_spelling() -> None:
    """A config object (e.g. built by a GGUF reader) with only top-level rope_theta + rope_scaling."""
    cfg = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        rms_norm_eps=1e-6,
        rope_theta=123.0,
        rope_scaling=dict(type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0),
        **_SHAPE,
    )
    arch = ModelArchConfig.from_hf(cfg, None)
    assert arch.rope_theta == 123.0
    # original_max_position_embeddings falls back to max_position_embeddings, as in transformers
    assert arch.rope_scaling == Llama3RopeScaling(4.0, 1.0, 2.0, 512)


def test_linear_rope_scaling() -> None:
    cfg = _llama(rope_parameters=dict(rope_type="linear", rope_theta=1e6, factor=8.0))
    arch = ModelArchConfig.from_hf(cfg, None)
    assert (arch.rope_theta, arch.rope_scaling) == (1e6, LinearRopeScaling(8.0))
    malformed = SimpleNamespace(
        architectures=["LlamaForCausalLM"], rms_norm_eps=1e-6, rope_parameters=dict(rope_type="linear"), **_SHAPE
    )
    with pytest.raises(UnsupportedModelError, match="lack 'factor'"):
        ModelArchConfig.from_hf(malformed, None)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])
def test_unsupported_rope_type_is_named(rope_type: str) -> None:
    cfg = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type=rope_type, rope_theta=1e4, factor=2.0),
        **_SHAPE,
    )
    with pytest.raises(UnsupportedModelError, match=f"rope type '{rope_type}'.*'linear', 'llama3'"):
        ModelArchConfig.from_hf(cfg, None)


def test_mistral_window_slides_every_layer_where_it_binds() -> None:
    cfg = transformers.MistralConfig(architectures=["MistralForCausalLM"], sliding_window=256, **_SHAPE)
    arch = ModelArchConfig.from_hf(cfg, max_model_len=None)  # 512 positions > window
    assert arch.layer_windows == (256, 256)
    assert [arch.layer_window(i) for i in range(2)] == [256, 256] and arch.kv_window == 256
    # A window as long as every sequence never binds: the layers attend globally and no block is freed.
    short = ModelArchConfig.from_hf(cfg, max_model_len=256)
    assert short.layer_window(0) is None and short.kv_window is None and short.is_sliding(0)
    assert ModelArchConfig.from_hf(cfg, max_model_len=257).layer_window(1) == 256
    none = transformers.MistralConfig(architectures=["MistralForCausalLM"], sliding_window=None, **_SHAPE)
    arch = ModelArchConfig.from_hf(none, None)
    assert arch.layer_windows == () and arch.layer_window(0) is None and arch.kv_window is None


@pytest.mark.parametrize("config_cls", ["Qwen2Config", "Qwen3Config"])
def test_qwen_sliding_window_only_when_used(config_cls: str) -> None:
    """transformers' rule: with use_sliding_window, layers from max_window_layers on slide (layer_types)."""
    cls = getattr(transformers, config_cls)
    arch_name = config_cls.replace("Config", "ForCausalLM")
    unused = cls(architectures=[arch_name], sliding_window=64, use_sliding_window=False, **_SHAPE)
    assert ModelArchConfig.from_hf(unused, None).layer_windows == ()
    used = cls(architectures=[arch_name], sliding_window=64, use_sliding_window=True, max_window_layers=1, **_SHAPE)
    arch = ModelArchConfig.from_hf(used, None)
    assert arch.layer_windows == (None, 64) and arch.kv_window is None  # a global layer keeps every block
    full = cls(architectures=[arch_name], sliding_window=64, use_sliding_window=True, max_window_layers=2, **_SHAPE)
    assert ModelArchConfig.from_hf(full, None).layer_windows == ()


def _gemma3(**kw: Any) -> transformers.Gemma3TextConfig:
    shape = {**_SHAPE, "num_hidden_layers": 6, "head_dim": 32, **kw}
    return transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **shape)


def test_gemma3_layer_types_local_rope_and_activation() -> None:
    """Five sliding layers then a global one (the default pattern); the global layers' rope_theta and linear
    scaling, the sliding ones' rope_local_base_freq; Gemma's activation and numerics."""
    cfg = _gemma3(sliding_window=16, rope_scaling=dict(rope_type="linear", factor=8.0), query_pre_attn_scalar=48)
    arch = ModelArchConfig.from_hf(cfg, None)
    assert arch.layer_windows == (16, 16, 16, 16, 16, None)
    assert [arch.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert arch.kv_window is None  # the global layer reads every key
    assert (arch.rope_theta, arch.rope_scaling, arch.local_rope_theta) == (1e6, LinearRopeScaling(8.0), 1e4)
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.query_pre_attn_scalar == 48.0
    assert arch.tie_word_embeddings


def test_gemma3_refusals() -> None:
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        ModelArchConfig.from_hf(_gemma3(use_bidirectional_attention=True), None)
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        ModelArchConfig.from_hf(_gemma3(hidden_activation="gelu"), None)
    cfg = SimpleNamespace(
        architectures=["Gemma3ForCausalLM"],
        rms_norm_eps=1e-6,
        sliding_window=16,
        layer_types=["sliding_attention", "chunked_attention"],
        rope_parameters={"full_attention": {"rope_theta": 1e6}},
        **_SHAPE,
    )
    with pytest.raises(UnsupportedModelError, match=r"layer_types=.*'chunked_attention'"):
        ModelArchConfig.from_hf(cfg, None)
    cfg.layer_types = ["sliding_attention", "full_attention"]
    cfg.rope_parameters = {
        "full_attention": {"rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    }
    with pytest.raises(UnsupportedModelError, match="rope scaling on sliding layers"):
        ModelArchConfig.from_hf(cfg, None)
    cfg.rope_parameters = {"global": {"rope_theta": 1e6}}
    with pytest.raises(UnsupportedModelError, match="per-layer-type rope parameters"):
        ModelArchConfig.from_hf(cfg, None)


def test_layer_windows_are_validated() -> None:
    arch = ModelArchConfig.from_hf(_llama(), None)
    with pytest.raises(UnsupportedModelError, match="3 layer windows for 2 layers"):
        dataclasses.replace(arch, layer_windows=(4, 4, 4))
    with pytest.raises(UnsupportedModelError, match="sliding_window=0"):
        dataclasses.replace(arch, layer_windows=(0, None))


def test_malformed_and_unsupported_configs() -> None:
    with pytest.raises(UnsupportedModelError, match="multiple of num_key_value_heads"):
        ModelArchConfig.from_hf(_llama(num_key_value_heads=3), None)
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelArchConfig.from_hf(_llama(hidden_act="gelu"), None)
    with pytest.raises(UnsupportedModelError, match="architectures"):
        ModelArchConfig.from_hf(transformers.LlamaConfig(**_SHAPE), None)
    with pytest.raises(UnsupportedModelError, match="max_model_len=0"):
        ModelArchConfig.from_hf(_llama(), 0)


def test_max_model_len_beyond_trained_positions_is_refused() -> None:
    config = _llama(max_position_embeddings=512)
    assert ModelArchConfig.from_hf(config, 512).max_model_len == 512
    with pytest.raises(ValueError, match=r"max_model_len=4096 exceeds .*max_position_embeddings \(512\)"):
        ModelArchConfig.from_hf(config, 4096)


def test_optional_numerics_are_read_when_the_config_has_them() -> None:
    """Gemma's softmax scale and logit softcap come from its config; absent (every Llama/Qwen config), None."""
    arch = ModelArchConfig.from_hf(_llama(), None)
    assert arch.query_pre_attn_scalar is None and arch.final_logit_softcapping is None
    arch = ModelArchConfig.from_hf(_llama(query_pre_attn_scalar=256, final_logit_softcapping=30.0), None)
    assert arch.query_pre_attn_scalar == 256.0 and arch.final_logit_softcapping == 30.0
    with pytest.raises(UnsupportedModelError, match=r"final_logit_softcapping=0\.0"):
        ModelArchConfig.from_hf(_llama(final_logit_softcapping=0.0), None)
