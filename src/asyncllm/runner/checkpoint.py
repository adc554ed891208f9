"""Opening a checkpoint: its config, tokenizer, EOS ids and a weight iterator, whatever the file format.

A Hugging Face directory (config.json + safetensors, one file or sharded) or a single `.gguf` file. Weights
come out under Hugging Face parameter names in the requested dtype, so model code loads both the same way.
Nothing here touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncllm.errors import UnsupportedModelError

WeightIterator = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class Checkpoint:
    path: Path
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: Any | None  # transformers fast tokenizer (chat template included), None if absent
    eos_token_ids: frozenset[int]
    iter_weights: WeightIterator  # yields (hf_name, tensor) pairs


def open_checkpoint(model: str, dtype: torch.dtype, tokenizer_path: str | None = None) -> Checkpoint:
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from asyncllm.runner.gguf_checkpoint import open_gguf_checkpoint

        return open_gguf_checkpoint(path, dtype)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is neither a checkpoint directory nor a .gguf file (no network access is attempted)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    return Checkpoint(
        path=path,
        hf_config=hf_config,
        tokenizer=_load_tokenizer(Path(tokenizer_path) if tokenizer_path else path),
        eos_token_ids=_eos_ids(path, hf_config),
        iter_weights=lambda: iter_safetensors(path, dtype),
    )


def iter_safetensors(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a one-file or sharded safetensors checkpoint, floating ones cast to `dtype`."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files (other weight formats are not supported)")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def _load_tokenizer(path: Path) -> Any | None:
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _eos_ids(path: Path, hf_config: Any) -> frozenset[int]:
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
