"""GGUF tensors as Hugging Face named torch tensors: names mapped, blocks dequantized, Q/K rows restored.

Owns the GGUF -> Hugging Face tensor-name table, the supported tensor types and the inverse of
llama.cpp's Q/K row permutation. Knows nothing about configs or tokenizers: the caller passes head counts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from asyncllm.errors import UnsupportedModelError

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names raise."""
    if match := _BLOCK_RE.fullmatch(gguf_name):
        layer, module, kind = match.groups()
        if module in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[module]}.{kind}"
    else:
        module, _, kind = gguf_name.rpartition(".")
        if module in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[module]}.{kind}"
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in the supported architectures"
    )


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
    *,
    num_heads: int,
    num_kv_heads: int,
    permuted_qk: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of `reader` as (hf_name, tensor in `dtype`), one tensor dequantized at a time."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        # GGUF lists dims innermost first; torch wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        # np.array copies: an F32 tensor would otherwise alias the reader's read-only memory map
        array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        weight = torch.from_numpy(array).to(dtype)
        if permuted_qk and ".self_attn.q_proj." in name:
            weight = unpermute_qk(weight, num_heads)
        elif permuted_qk and ".self_attn.k_proj." in name:
            weight = unpermute_qk(weight, num_kv_heads)
        yield name, weight
