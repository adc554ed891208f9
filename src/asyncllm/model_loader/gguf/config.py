"""A GGUF file's metadata turned into a transformers config for the architectures asyncllm serves.

Owns how the `{arch}.*` keys map onto Hugging Face config fields; which GGUF architectures are served is
their entry in `models/registry.py`. Knows nothing about tensors' contents, tokenizers
or the engine; reads metadata from the `GGUFHeader` the caller read.
"""

from __future__ import annotations

from typing import Any

from asyncllm.errors import UnsupportedModelError
from asyncllm.model_loader.gguf.header import GGUFHeader
from asyncllm.models.registry import Architecture, GGUFForm, resolve_gguf_architecture


def read_field(header: GGUFHeader, key: str) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or list of those); None when absent."""
    return header.get(key)


def architecture_of(header: GGUFHeader) -> tuple[str, Architecture, GGUFForm]:
    """(the file's `general.architecture`, its registry entry, that entry's GGUF form)."""
    name = read_field(header, "general.architecture")
    arch = resolve_gguf_architecture(name)
    assert arch.gguf is not None
    return name, arch, arch.gguf


def build_hf_config(header: GGUFHeader, tensor_names: set[str]) -> Any:
    """A transformers config equivalent to the GGUF metadata (`architectures` set, tying inferred): the base
    `PretrainedConfig` with every field the models read set explicitly. The family's own class (LlamaConfig)
    would add only defaults nobody reads, and importing it costs ~1.2 s (transformers 5 pulls its model-loading
    machinery in with it)."""
    from transformers import PretrainedConfig

    name, arch, form = architecture_of(header)

    def required(suffix: str) -> Any:
        value = read_field(header, f"{name}.{suffix}")
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {name}.{suffix}: the file is incomplete")
        if isinstance(value, list):
            raise UnsupportedModelError(
                f"GGUF metadata {name}.{suffix} is per-layer ({value[:4]}...); only uniform layers are supported"
            )
        return value

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kv_heads = read_field(header, f"{name}.attention.head_count_kv")
    if isinstance(kv_heads, list):
        raise UnsupportedModelError(f"GGUF {name}.attention.head_count_kv is per-layer; not supported")
    head_dim = read_field(header, f"{name}.attention.key_length") or hidden // heads
    value_dim = read_field(header, f"{name}.attention.value_length")
    if value_dim is not None and value_dim != head_dim:
        raise UnsupportedModelError(f"GGUF key_length {head_dim} != value_length {value_dim}: not supported")
    kwargs: dict[str, Any] = dict(
        architectures=[arch.name],
        vocab_size=vocab_size(header, name),
        hidden_size=hidden,
        intermediate_size=int(required("feed_forward_length")),
        num_hidden_layers=int(required("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(required("context_length")),
        # `rope_theta` is accepted by every supported transformers version (5.x folds it into rope_parameters)
        rope_theta=float(read_field(header, f"{name}.rope.freq_base") or 10000.0),
        tie_word_embeddings="output.weight" not in tensor_names,
        hidden_act="silu",
    )
    rope_dims = read_field(header, f"{name}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise UnsupportedModelError(
            f"GGUF rope.dimension_count={rope_dims} != head_dim={head_dim}: partial rotary is not supported"
        )
    scaling = read_field(header, f"{name}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp bakes llama3-style frequency scaling into a tensor whose parameters are not in metadata;
        # loading it as plain RoPE would silently change every answer.
        raise UnsupportedModelError(
            "this GGUF has per-frequency RoPE scaling (rope_freqs, e.g. Llama 3.1+), which asyncllm cannot "
            "read from GGUF yet; load the model's Hugging Face checkpoint directory instead"
        )
    experts = read_field(header, f"{name}.expert_count")
    if experts:  # a MoE file: every layer's MLP is its experts (llama.cpp writes no dense layers beside them)
        renormalize = read_field(header, f"{name}.expert_weights_norm")
        kwargs.update(
            num_experts=int(experts),
            num_experts_per_tok=int(required("expert_used_count")),
            moe_intermediate_size=int(required("expert_feed_forward_length")),
            norm_topk_prob=form.renormalizes_experts if renormalize is None else bool(renormalize),
        )
    if form.attention_bias_from_tensors:
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    for key in ("bos", "eos", "padding"):
        token_id = read_field(header, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            kwargs["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return PretrainedConfig(**kwargs)


def vocab_size(header: GGUFHeader, arch_name: str) -> int:
    """Rows of the embedding: `{arch}.vocab_size` when given, else the tokenizer's token count."""
    explicit = read_field(header, f"{arch_name}.vocab_size")
    if explicit is not None:
        return int(explicit)
    tokens = header.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise UnsupportedModelError("GGUF metadata has neither a vocab_size nor a token list")
    return len(tokens)


def eos_token_ids(header: GGUFHeader) -> set[int]:
    """EOS, end-of-turn and end-of-message ids that llama.cpp stops on, from metadata."""
    ids = set()
    for key in ("eos", "eot", "eom"):
        token_id = read_field(header, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            ids.add(int(token_id))
    return ids
