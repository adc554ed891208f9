"""Reading the tensors of a one-file or sharded safetensors checkpoint, whole or one slice of each (a
tensor-parallel rank reads only its shard)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from asyncllm.errors import ModelNotFoundError
from asyncllm.model_loader.base import ShardSelector


def count_safetensors(path: Path) -> int:
    """The tensors of the checkpoint directory `path` (each file's header only: nothing is read)."""
    from safetensors import safe_open

    count = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            count += len(f.keys())
    return count


def iter_safetensors(
    path: Path, dtype: torch.dtype, select: ShardSelector | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint directory `path`, 16/32-bit floating ones cast to `dtype`; with `select`,
    only the slice it names of each tensor is read from the file."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors files (other weight formats are not supported)")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shard = select(name) if select is not None else None
                if shard is None:
                    tensor = f.get_tensor(name)
                else:
                    index = (slice(None),) * shard.dim + (slice(shard.start, shard.stop),)
                    tensor = shard.pad(f.get_slice(name)[index])
                # 8-bit floats are quantized weights (e4m3): their bytes are kept for the quantized layers
                cast = tensor.is_floating_point() and tensor.element_size() > 1
                yield name, tensor.to(dtype) if cast else tensor
