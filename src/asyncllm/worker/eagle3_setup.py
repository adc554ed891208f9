"""`load_eagle3`: the head of `speculative_config={"method": "eagle3", "model": ...}`, read from its directory
(config.json and safetensors, as vLLM and SGLang load the published heads), checked against the target and
loaded beside it on its device and in its dtype, with an attention backend of its own; and the target made to
copy out the hidden states the head reads (models/aux_hidden.py: only while eagle3 is on).

A head that cannot serve this target fails here, while the engine is built, with a one-line
`InvalidConfigError` naming `speculative_config['model']`: not an EAGLE-3 head, another hidden size or
vocabulary, target layers the target lacks, missing or misshapen tensors, or a target family whose hidden
states cannot be read. Knows nothing of steps or requests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import AsyncLLMError, InvalidConfigError
from asyncllm.layers.param_dtype import parameters_in
from asyncllm.model_loader.safetensors import iter_safetensors
from asyncllm.models.aux_hidden import AuxHidden
from asyncllm.models.base import CausalLM
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.eagle3 import EAGLE3_ARCHITECTURES, Eagle3Head
from asyncllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.draft_backend import draft_attention_backend
from asyncllm.worker.eagle3 import LoadedEagle3
from asyncllm.worker.kv_cache import KVCacheSpec

__all__ = ["LoadedEagle3", "load_eagle3"]

_KEY = "speculative_config['model']"


def load_eagle3(config: EngineConfig, target: CausalLM, resolved: ResolvedModel) -> LoadedEagle3 | None:
    """The head, loaded, and `target` copying out its hidden states; None unless the method is "eagle3"."""
    spec = config.scheduler_config.speculative
    if spec is None or spec.method != "eagle3":
        return None
    assert spec.model is not None  # SpeculativeConfig checked it
    try:
        return _load(config, Path(spec.model).expanduser(), spec.num_speculative_tokens, target, resolved)
    except AsyncLLMError as exc:  # a tensor missing, unknown or misshapen: the loader says which
        if isinstance(exc, InvalidConfigError) and _KEY in str(exc):
            raise
        raise InvalidConfigError(f"{_KEY}={spec.model!r} cannot be the EAGLE-3 head: {exc}") from None


def _load(config: EngineConfig, path: Path, k: int, target: CausalLM, resolved: ResolvedModel) -> LoadedEagle3:
    hf = _read_config(path)
    llama = _llama_target(target)
    arch, layers, target_hidden = _resolve(hf, resolved)
    device, dtype = resolved.device, resolved.dtype
    weights = dict(iter_safetensors(path, dtype))
    own_embedding = "embed_tokens.weight" in weights
    if arch.hidden_size != target_hidden and not own_embedding:
        raise InvalidConfigError(
            f"{_KEY}: the head's hidden_size ({arch.hidden_size}) is not the target's ({target_hidden}) and it has "
            "no embed_tokens.weight of its own: the target's embedding cannot feed it"
        )
    draft_vocab = hf.get("draft_vocab_size") or arch.vocab_size
    _check_vocab_map(weights, draft_vocab, arch.vocab_size)
    backend = draft_attention_backend(config, arch, resolved)
    qkv_bias = bool(hf.get("attention_bias", False))
    norm_before_residual = bool(hf.get("norm_before_residual", False))
    with torch.device(device), parameters_in(dtype):
        head = Eagle3Head(
            arch, backend, target_hidden, len(layers), draft_vocab, own_embedding, qkv_bias, norm_before_residual
        )
    head = head.to(dtype=dtype).eval()
    head.load_weights(weights.items())
    embed = head.embed_tokens if head.embed_tokens is not None else llama.model.embed_tokens
    # The target copies its hidden states for every token of a step (the step's bound, padding included).
    max_tokens = config.scheduler_config.max_num_batched_tokens
    aux = AuxHidden(layers, target_hidden, max_tokens, device, dtype)
    llama.aux_hidden = aux
    kv_spec = KVCacheSpec(1, arch.num_kv_heads, arch.head_dim, config.cache_config.block_size, dtype)
    return LoadedEagle3(head, embed, backend, kv_spec, k, aux, max_tokens)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidConfigError(f"{_KEY}: cannot read {path / 'config.json'}: {exc}") from None
    if not isinstance(hf, dict):
        raise InvalidConfigError(f"{_KEY}: {path / 'config.json'} is not a JSON object")
    architectures = hf.get("architectures")
    if not architectures or architectures[0] not in EAGLE3_ARCHITECTURES:
        raise InvalidConfigError(
            f"{_KEY}: config.json names architectures={architectures!r}, not an EAGLE-3 head "
            f"({' or '.join(EAGLE3_ARCHITECTURES)})"
        )
    return hf


def _llama_target(target: CausalLM) -> LlamaForCausalLM:
    """The target, if a family whose forward pass copies out hidden states: Llama's (Llama, Mistral, Qwen2,
    Qwen3, Qwen3-MoE), whose layers keep the residual stream as x + residual."""
    if (
        isinstance(target, LlamaForCausalLM)
        and type(target).forward is LlamaForCausalLM.forward
        and all(isinstance(layer, LlamaDecoderLayer) for layer in target.model.layers)
    ):
        return target
    raise InvalidConfigError(
        f"{_KEY}: an EAGLE-3 head cannot read the hidden states of a {target.arch.architecture} target: "
        "supported targets are the Llama family's (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE)"
    )


def _resolve(hf: dict[str, Any], target: ResolvedModel) -> tuple[ModelArchConfig, tuple[int, ...], int]:
    """The head's architecture (its RoPE tables cover the target's positions), the target layers it reads,
    and the target's hidden size, each checked against the target."""
    tarch = target.arch
    hidden = hf.get("target_hidden_size") or hf.get("hidden_size")
    if hidden != tarch.hidden_size:
        raise InvalidConfigError(
            f"{_KEY}: the head reads hidden states of size {hidden} (target_hidden_size, else hidden_size), the "
            f"target's are {tarch.hidden_size}: a head trained for another target"
        )
    if hf.get("vocab_size") != tarch.vocab_size:
        raise InvalidConfigError(
            f"{_KEY}: the head's vocab_size is {hf.get('vocab_size')}, the target's {tarch.vocab_size}: a head "
            "trained for another tokenizer"
        )
    if hf.get("num_hidden_layers", 1) != 1:
        raise InvalidConfigError(
            f"{_KEY}: a head of num_hidden_layers={hf.get('num_hidden_layers')} is not supported: one (midlayer)"
        )
    eagle = hf.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise InvalidConfigError(f"{_KEY}: eagle_config.use_aux_hidden_state=false is not supported (EAGLE-3 only)")
    n = tarch.num_layers
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(ids) if ids else (2, n // 2, n - 3)  # vLLM's choice when the head names none
    if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i <= n for i in layers):
        raise InvalidConfigError(
            f"{_KEY}: eagle_aux_hidden_state_layer_ids={list(layers)} must be three layer ids in [0, {n}] for "
            f"this {n}-layer target" + ("" if ids else " (the default (2, L // 2, L - 3) needs 5 layers or more)")
        )
    positions = hf.get("max_position_embeddings")
    if isinstance(positions, int) and positions < tarch.max_model_len:
        raise InvalidConfigError(
            f"{_KEY}: the head's max_position_embeddings ({positions}) is shorter than the target's "
            f"max_model_len ({tarch.max_model_len}): use max_model_len <= {positions}"
        )
    # transformers' Llama config reads the RoPE and head_dim spellings as the published heads write them.
    from transformers.models.llama.configuration_llama import LlamaConfig

    fields = {key: value for key, value in hf.items() if key not in ("architectures", "model_type")}
    llama = LlamaConfig(**fields)
    llama.architectures = ["LlamaForCausalLM"]
    arch = ModelArchConfig.from_hf(llama, tarch.max_model_len)
    return dataclasses.replace(arch, architecture=hf["architectures"][0]), layers, tarch.hidden_size


def _check_vocab_map(weights: dict[str, torch.Tensor], draft_vocab: int, vocab: int) -> None:
    """`d2t` maps every draft id into the target's vocabulary; without it the vocabularies must be one."""
    d2t = weights.get("d2t")
    if d2t is None:
        if draft_vocab != vocab:
            raise InvalidConfigError(
                f"{_KEY}: the head drafts over {draft_vocab} ids (draft_vocab_size) but has no d2t tensor mapping "
                f"them to the target's {vocab}"
            )
        return
    if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
        raise InvalidConfigError(
            f"{_KEY}: d2t has shape {tuple(d2t.shape)} ({d2t.dtype}), not [{draft_vocab}] integers (draft_vocab_size)"
        )
    targets = torch.arange(draft_vocab) + d2t.to(torch.int64)
    if draft_vocab and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise InvalidConfigError(
            f"{_KEY}: d2t maps draft ids outside the target's vocabulary of {vocab}: a head for another tokenizer"
        )
