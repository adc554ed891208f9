"""Opening a Hugging Face checkpoint directory: config.json, tokenizer files, EOS ids, safetensors weights.

Nothing here touches the network: transformers is asked for local files only.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from asyncllm.errors import ModelNotFoundError, UnsupportedModelError
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.safetensors import count_safetensors, iter_safetensors
from asyncllm.models.registry import resolve_architecture


def open_hf_checkpoint(
    path: Path, dtype: torch.dtype, tokenizer_path: Path | None, background_tokenizer: bool = False
) -> Checkpoint:
    """`background_tokenizer`: the tokenizer loads on a thread of its own (`Checkpoint.load_tokenizer` waits for
    it), beside the weights' load; a given tokenizer directory's presence is still checked here."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    check_architecture(path / "config.json")
    if tokenizer_path is not None:
        check_given_tokenizer(tokenizer_path)
    # Both imported here, before any second thread: transformers imported on two threads at once can hand one
    # of them a half-initialised module ("cannot import name 'AutoTokenizer'").
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    load = partial(load_tokenizer, path if tokenizer_path is None else tokenizer_path)
    background = background_tokenizer and (tokenizer_path is not None or has_tokenizer(path))  # else none to load
    pending = in_background(load) if background else None
    return Checkpoint(
        path=path,
        hf_config=hf_config,
        tokenizer=load() if pending is None else None,
        load_tokenizer=pending,
        eos_token_ids=eos_ids(path, hf_config),
        iter_weights=lambda: iter_safetensors(path, dtype),
        iter_weight_shards=lambda select: iter_safetensors(path, dtype, select),
        num_tensors=count_safetensors(path),
    )


def reopen_hf_checkpoint(
    path: Path, dtype: torch.dtype, tokenizer_path: Path | None, eos_token_ids: frozenset[int]
) -> Checkpoint:
    """A directory rank 0 opened, reopened by a worker rank: its weights, with rank 0's EOS ids. The config is
    not parsed (the worker builds from rank 0's resolved model) and the tokenizer is loaded at first use: the
    worker imports transformers, a large part of its start-up, only once a constraint needs the tokenizer."""
    load: Callable[[], Any] | None = None
    if tokenizer_path is not None:
        load = partial(load_given_tokenizer, tokenizer_path)
    elif has_tokenizer(path):
        load = partial(load_tokenizer, path)
    return Checkpoint(
        path=path,
        hf_config=None,
        tokenizer=None,
        eos_token_ids=eos_token_ids,
        iter_weights=lambda: iter_safetensors(path, dtype),
        iter_weight_shards=lambda select: iter_safetensors(path, dtype, select),
        num_tensors=count_safetensors(path),
        load_tokenizer=load,
    )


def check_architecture(config_json: Path) -> None:
    """UnsupportedModelError naming the checkpoint's architecture and the supported ones, before anything
    else reads the config: another family's fields (GPT-2's n_embd, Phi's activation) would fail less clearly."""
    try:
        config = json.loads(config_json.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"{config_json} is not a readable JSON config: {exc}") from exc
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not architectures:
        raise UnsupportedModelError(f"{config_json} names no `architectures`: asyncllm cannot tell which model it is")
    resolve_architecture(architectures[0])


def load_tokenizer(path: Path) -> Any | None:
    """The fast tokenizer saved in `path`, None when the directory has no tokenizer files."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers' and the Rust tokenizer's many kinds, none naming the directory
        raise UnsupportedModelError(f"the tokenizer in {path} could not be loaded: {exc}") from exc


def has_tokenizer(path: Path) -> bool:
    """Whether the directory holds tokenizer files."""
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def load_given_tokenizer(path: Path) -> Any:
    """The tokenizer at a path the user named: unlike the checkpoint's own (optional), it must be there."""
    check_given_tokenizer(path)
    return load_tokenizer(path)


def check_given_tokenizer(path: Path) -> None:
    """ModelNotFoundError unless the directory the user named holds tokenizer files."""
    if not path.is_dir():
        raise ModelNotFoundError(f"tokenizer={str(path)!r} is not a directory: give a local tokenizer directory")
    if not has_tokenizer(path):
        raise ModelNotFoundError(
            f"tokenizer={str(path)!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json)"
        )


def in_background(load: Callable[[], Any]) -> Callable[[], Any]:
    """Starts `load` on a thread of its own; the returned call waits for its result (or raises its error).
    A tokenizer's load (~0.7 s on a CPU host) is Python and JSON parsing; a worker's set-up waits on files and
    the device in stretches that release the GIL, where the two can overlap. The caller imports transformers
    first: the module imported on two threads at once can reach one of them half-initialised."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncllm-tokenizer")
    future = pool.submit(load)
    pool.shutdown(wait=False)
    return future.result


def eos_ids(path: Path, hf_config: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list), else from config.json."""
    gen = path / "generation_config.json"
    value: Any = None
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    if value is None:
        return frozenset()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) for i in ids):
        raise UnsupportedModelError(f"eos_token_id {value!r} in {path} is not an int or list of ints")
    return frozenset(ids)
