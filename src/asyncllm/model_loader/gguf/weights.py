"""GGUF tensors as Hugging Face named torch tensors: names mapped, blocks dequantized, Q/K rows restored.

Owns llama.cpp's naming convention (`blk.{i}.{name}.weight`), the supported tensor types and the inverse of
llama.cpp's Q/K row permutation; each family's table of names is its `GGUFNames`, passed in. Knows nothing
about configs or tokenizers: the caller passes head counts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from asyncllm.errors import UnsupportedModelError
from asyncllm.models.family import GGUFNames

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, names: GGUFNames) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (Llama's names); unknown names raise."""
    if match := _BLOCK_RE.fullmatch(gguf_name):
        layer, module, kind = match.groups()
        if module in names.blocks:
            return f"{names.layers}.{layer}.{names.blocks[module]}.{kind}"
    else:
        module, _, kind = gguf_name.rpartition(".")
        if module in names.globals and kind in ("weight", "bias"):
            return f"{names.globals[module]}.{kind}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this architecture")


def supported_tensor_types() -> frozenset[Any]:
    """F32, F16 and every block type `gguf.quants` can dequantize (Q4_0..Q8_0, K-quants, BF16, ...)."""
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    # gguf.quants names one dequantizer class after each type it supports.
    return frozenset({T.F32, T.F16} | {t for t in T if isinstance(getattr(gguf.quants, t.name, None), type)})


def check_tensor_types(tensors: list[Any]) -> None:
    """Fail before loading anything when a tensor's type cannot be dequantized."""
    supported = supported_tensor_types()
    for tensor in tensors:
        if tensor.tensor_type not in supported:
            names = ", ".join(sorted(t.name for t in supported))
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which asyncllm cannot "
                f"dequantize; supported types: {names}"
            )


def check_tensor_sizes(path: Any, tensors: list[Any]) -> None:
    """Every tensor's stored bytes must match its shape and type: a truncated file fails here, clearly,
    rather than as a numpy reshape error halfway through loading."""
    from gguf import GGML_QUANT_SIZES

    for tensor in tensors:
        block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        expected = int(tensor.n_elements) // block * type_size
        if int(tensor.data.nbytes) != expected:
            raise UnsupportedModelError(
                f"{path}: tensor {tensor.name!r} holds {int(tensor.data.nbytes)} bytes, but its shape and type "
                f"({tensor.tensor_type.name}) need {expected}: the file is truncated or corrupt"
            )


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head it interleaves the two rotary halves, row by row.

    llama.cpp stores, for each head, rows (0, d/2, 1, d/2+1, ...) so its rotary kernel can rotate adjacent
    pairs; Hugging Face's rotate_half wants (0, 1, ..., d-1). `weight`: [num_heads * head_dim, ...].
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise UnsupportedModelError(
            f"a Q/K projection has {rows} rows, not a multiple of 2 x {num_heads} heads: the GGUF's head "
            "counts do not match its weights"
        )
    half = rows // num_heads // 2
    # [heads, half, 2, ...] -> [heads, 2, half, ...]: pairs back into two contiguous halves
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(
    reader: Any,
    dtype: torch.dtype,
    names: GGUFNames,
    *,
    num_heads: int,
    num_kv_heads: int,
    permuted_qk: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of `reader` as (hf_name, tensor in `dtype`), one tensor dequantized at a time."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = hf_name(tensor.name, names)
        # GGUF lists dims innermost first; torch wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        # np.array copies: an F32 tensor would otherwise alias the reader's read-only memory map
        array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        weight = torch.from_numpy(array).to(dtype)
        module = match[2] if permuted_qk and (match := _BLOCK_RE.fullmatch(tensor.name)) else None
        if module == "attn_q":  # llama.cpp's query projection
            weight = unpermute_qk(weight, num_heads)
        elif module == "attn_k":
            weight = unpermute_qk(weight, num_kv_heads)
        yield name, weight
