"""Opening a single `.gguf` file as a `Checkpoint`: config, tokenizer, EOS ids and weights (dequantized, or the
linear layers' kept quantized: the config's `quantization_config` names their tensor types for the scheme).

Composes the header reader (header.py), the metadata's config (config.py), the tensor reader (weights.py)
with the family's GGUF names from its registry entry, and transformers' GGUF tokenizer support. Everything is
checked at open time (architecture, tensor names and types), so a bad file fails before any weight is loaded.
Nothing here touches the network.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from asyncllm.errors import UnsupportedModelError
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.gguf.config import architecture_of, build_hf_config, eos_token_ids, read_field
from asyncllm.model_loader.gguf.header import GGUFHeader, read_gguf_header
from asyncllm.model_loader.gguf.weights import (
    check_tensor_sizes,
    check_tensor_types,
    hf_name,
    iter_gguf_weights,
    type_name,
)
from asyncllm.model_loader.hf import load_given_tokenizer
from asyncllm.quantization.scheme import QuantScheme

# Turn-end markers of common chat templates: a chat answer ends with one even when the GGUF's
# eos_token_id names another token (e.g. <|endoftext|>), so they stop generation too.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

logger = logging.getLogger("asyncllm.model_loader")


def open_gguf_checkpoint(path: Path, dtype: torch.dtype, tokenizer_path: Path | None = None) -> Checkpoint:
    """Validate the whole file, then return its config, tokenizer and a weight iterator yielding `dtype`.
    `tokenizer_path`: a tokenizer directory the user named, used instead of the one the file describes."""
    header, checkpoint = _open(path, dtype)
    tokenizer = _load_tokenizer(path, header) if tokenizer_path is None else load_given_tokenizer(tokenizer_path)
    eos = eos_token_ids(header) | _turn_end_ids(tokenizer)
    return replace(checkpoint, tokenizer=tokenizer, eos_token_ids=frozenset(eos))


def reopen_gguf_checkpoint(
    path: Path, dtype: torch.dtype, tokenizer_path: Path | None, eos: frozenset[int]
) -> Checkpoint:
    """The file rank 0 opened, reopened by a worker rank: its config and weights, with rank 0's EOS ids (they
    depend on the tokenizer); the tokenizer, rebuilt from the vocabulary, is loaded at first use (only a
    constraint's grammar reads it)."""
    header, checkpoint = _open(path, dtype)
    load: Callable[[], Any] | None = None
    if tokenizer_path is not None:
        load = partial(load_given_tokenizer, tokenizer_path)
    elif read_field(header, "tokenizer.ggml.model") is not None:
        load = partial(_load_tokenizer, path, header)
    return replace(checkpoint, eos_token_ids=eos, load_tokenizer=load)


def _open(path: Path, dtype: torch.dtype) -> tuple[GGUFHeader, Checkpoint]:
    """The header, and the checkpoint without its tokenizer and EOS ids, every tensor checked."""
    try:
        header = read_gguf_header(path)  # tensors are read (mapped) only when iterated
    except OSError as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {exc}") from exc
    _, arch, form = architecture_of(header)
    tensor_names = {t.name for t in header.tensors}
    hf_config = build_hf_config(header, tensor_names)
    names = arch.gguf_names  # the family's GGUF tensor names
    for name in sorted(tensor_names):
        hf_name(name, names)  # raises on a tensor we would not know where to put
    check_tensor_types(header.tensors)
    check_tensor_sizes(header)

    # The linear layers' tensor types: the scheme decides from them which layers stay quantized, and how.
    plan = arch.model_class.family.weights
    linear = set(plan.column_parallel) | set(plan.row_parallel)
    module_types = {}
    for t in header.tensors:
        module, _, kind = hf_name(t.name, names).rpartition(".")
        if kind == "weight" and _module(module) in linear:
            module_types[module] = type_name(t)
    types = {t.name: type_name(t) for t in header.tensors}
    hf_config.quantization_config = {
        "quant_method": "gguf",
        "linear_types": sorted(set(module_types.values())),
        "module_types": module_types,
        # the LM head's stored type (its own, else the tied embedding's): whether 8-bit codes hold it
        "head_type": types.get("output.weight", types.get("token_embd.weight")),
    }

    def iter_quantized_weights(keep: Mapping[str, QuantScheme]) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_gguf_weights(
            header,
            dtype,
            names,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_key_value_heads,
            permuted_qk=form.permuted_qk,
            keep=keep,
        )

    return header, Checkpoint(
        path=path,
        hf_config=hf_config,
        tokenizer=None,
        eos_token_ids=frozenset(),
        iter_weights=lambda: iter_quantized_weights({}),
        num_tensors=len(header.tensors),
        iter_quantized_weights=iter_quantized_weights,
    )


def _module(name: str) -> str:
    """model.layers.0.self_attn.q_proj -> q_proj"""
    return name.rpartition(".")[2]


def _load_tokenizer(path: Path, header: GGUFHeader) -> Any | None:
    """transformers' tokenizer rebuilt from the GGUF's vocabulary, merges and chat template."""
    if read_field(header, "tokenizer.ggml.model") is None:
        return None  # no tokenizer in the file: prompts must then be token ids
    from transformers import PreTrainedTokenizerFast

    logger.info("building the tokenizer from the GGUF metadata of %s", path.name)
    # transformers rebuilds the backend tokenizer (BPE or sentencepiece) from the file's type and vocabulary
    # whichever class wraps it; AutoTokenizer would also re-derive a model config from the whole file first
    # (slow on a large vocabulary), which we already have.
    try:
        return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise UnsupportedModelError(f"cannot build a tokenizer from the GGUF metadata of {path}: {exc}") from exc


def _turn_end_ids(tokenizer: Any | None) -> set[int]:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return set()
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in _TURN_END_TOKENS if t in template and t in vocab}
