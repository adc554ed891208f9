"""`open_checkpoint`: a model path, whatever its format, as a `Checkpoint`.

A Hugging Face directory (config.json + safetensors, one file or sharded) or a single `.gguf` file.
Nothing here touches the network.
"""

from __future__ import annotations

from pathlib import Path

import torch

from asyncllm.errors import ModelNotFoundError
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.gguf.checkpoint import open_gguf_checkpoint, reopen_gguf_checkpoint
from asyncllm.model_loader.hf import open_hf_checkpoint, reopen_hf_checkpoint

__all__ = ["Checkpoint", "open_checkpoint", "reopen_checkpoint"]


def open_checkpoint(
    model: str, dtype: torch.dtype, tokenizer_path: str | None = None, background_tokenizer: bool = False
) -> Checkpoint:
    """`background_tokenizer`: a directory's tokenizer loads on a thread of its own while the caller goes on
    (`Checkpoint.loaded_tokenizer()` waits for it); a GGUF file's comes from its own metadata, at once."""
    path = Path(model).expanduser()
    given = Path(tokenizer_path).expanduser() if tokenizer_path else None
    if path.is_file() and path.suffix == ".gguf":
        return open_gguf_checkpoint(path, dtype, given)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {model!r} is neither a checkpoint directory nor a .gguf file (no network access is attempted)"
        )
    return open_hf_checkpoint(path, dtype, given, background_tokenizer)


def reopen_checkpoint(
    model: str, dtype: torch.dtype, tokenizer_path: str | None, eos_token_ids: frozenset[int]
) -> Checkpoint:
    """The checkpoint rank 0 opened (`open_checkpoint`), reopened by a tensor-parallel worker: the weights, with
    rank 0's EOS ids. The tokenizer is not loaded (`Checkpoint.load_tokenizer` loads it at first use: only a
    constraint's grammar needs it), nor a directory's config (the worker builds from rank 0's resolved model)."""
    path = Path(model).expanduser()
    given = Path(tokenizer_path).expanduser() if tokenizer_path else None
    if path.is_file() and path.suffix == ".gguf":
        return reopen_gguf_checkpoint(path, dtype, given, eos_token_ids)
    return reopen_hf_checkpoint(path, dtype, given, eos_token_ids)
