"""Reading the tensors of a one-file or sharded safetensors checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from asyncllm.errors import ModelNotFoundError


def iter_safetensors(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint directory `path`, floating ones cast to `dtype`."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors files (other weight formats are not supported)")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
