"""GGUF tensors as Hugging Face named torch tensors: names mapped, blocks dequantized, Q/K rows restored.

Owns llama.cpp's naming convention (`blk.{i}.{name}.weight`), the supported tensor types and the inverse of
llama.cpp's Q/K row permutation; each family's table of names is its `GGUFNames`, passed in. The file is
mapped only while its weights are read (`dequant.py` turns each tensor's bytes into floats; `repack.py` keeps
the linear layers' blocks quantized when asked). Knows nothing
about configs or tokenizers: the caller passes head counts.
"""

from __future__ import annotations

import contextlib
import mmap
import re
from collections.abc import Iterator, Mapping

import torch

from asyncllm.errors import UnsupportedModelError
from asyncllm.model_loader.gguf.dequant import TORCH_TYPES, dequantize
from asyncllm.model_loader.gguf.header import GGUFHeader, GGUFTensorInfo, open_data
from asyncllm.model_loader.gguf.repack import repack
from asyncllm.models.family import GGUFNames
from asyncllm.quantization.scheme import QuantScheme

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


def supported_tensor_types() -> frozenset[str]:
    """The type names we dequantize: F32, F16, BF16 and every block type `gguf.quants` knows (Q4_0..Q8_0,
    K-quants, ...); the common ones in torch (`dequant.py`)."""
    import gguf.quants
    from gguf import GGMLQuantizationType as T

    # gguf.quants names one dequantizer class after each type it supports.
    return TORCH_TYPES | {t.name for t in T if isinstance(getattr(gguf.quants, t.name, None), type)}


def type_name(info: GGUFTensorInfo) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(info.ggml_type).name


def check_tensor_types(tensors: tuple[GGUFTensorInfo, ...]) -> None:
    """Fail before loading anything when a tensor's type cannot be dequantized."""
    supported = supported_tensor_types()
    for tensor in tensors:
        if type_name(tensor) not in supported:
            names = ", ".join(sorted(supported))
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name!r} has type {type_name(tensor)}, which asyncllm cannot "
                f"dequantize; supported types: {names}"
            )


def check_tensor_sizes(header: GGUFHeader) -> None:
    """Every tensor's bytes must lie inside the file: a truncated file fails here, clearly, rather than
    halfway through loading."""
    for tensor in header.tensors:
        if tensor.offset + tensor.nbytes > header.file_size:
            raise UnsupportedModelError(
                f"{header.path}: tensor {tensor.name!r} needs bytes {tensor.offset}..{tensor.offset + tensor.nbytes} "
                f"({type_name(tensor)}, shape {list(tensor.shape)}), but the file ends at {header.file_size}: "
                "the file is truncated or corrupt"
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
    header: GGUFHeader,
    dtype: torch.dtype,
    names: GGUFNames,
    *,
    num_heads: int,
    num_kv_heads: int,
    permuted_qk: bool,
    keep: Mapping[str, QuantScheme] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the file as (hf_name, tensor in `dtype`), one tensor dequantized at a time; the weights
    of the modules in `keep` (checkpoint module name -> its layer's scheme) repacked instead, in that scheme's
    layout, as `{module}.qweight`, `.scales` and `.qzeros` or `.mins` (repack.py)."""
    keep = keep or {}
    data = open_data(header.path)
    try:
        for tensor in header.tensors:
            name = hf_name(tensor.name, names)
            module = match[2] if permuted_qk and (match := _BLOCK_RE.fullmatch(tensor.name)) else None
            heads = {"attn_q": num_heads, "attn_k": num_kv_heads}.get(module or "")  # llama.cpp's Q/K rows
            module_name, _, kind = name.rpartition(".")
            if module_name in keep and kind == "weight":
                raw = torch.frombuffer(data, dtype=torch.uint8, count=tensor.nbytes, offset=tensor.offset)
                for param, part in repack(raw, type_name(tensor), tensor.shape, keep[module_name]).items():
                    yield f"{module_name}.{param}", part if heads is None else unpermute_qk(part, heads)
            else:
                weight = _read(data, tensor).to(dtype)
                yield name, weight if heads is None else unpermute_qk(weight, heads)
            _release(data, tensor)
    finally:
        # Every tensor yielded is a copy, so no view of the mapping outlives the loop; should a consumer stop
        # mid-tensor, the mapping goes with the last view of it.
        with contextlib.suppress(BufferError):
            data.close()


def _release(data: mmap.mmap, tensor: GGUFTensorInfo) -> None:
    """The tensor's pages out of this process's resident memory once it is copied (the page cache keeps them, a
    later read maps them again): otherwise the whole file counts as resident until the loop ends, on top of the
    weights copied out of it (a CPU load's peak)."""
    if hasattr(mmap, "MADV_DONTNEED"):
        start = tensor.offset - tensor.offset % mmap.PAGESIZE
        data.madvise(mmap.MADV_DONTNEED, start, tensor.offset + tensor.nbytes - start)


def _read(data: mmap.mmap, tensor: GGUFTensorInfo) -> torch.Tensor:
    raw = torch.frombuffer(data, dtype=torch.uint8, count=tensor.nbytes, offset=tensor.offset)
    return dequantize(raw, type_name(tensor), tensor.shape)
