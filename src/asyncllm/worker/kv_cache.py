"""Sizing and allocating the paged KV cache.

On CUDA the cache takes what `gpu_memory_utilization` leaves after weights and a profiled peak activation;
on CPU ASYNCLLM_CPU_KVCACHE_SPACE GiB, by default one full-length sequence's worth within [1/4, 1] GiB. Either
way it is capped at what `max_num_seqs` full-length sequences could use.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from asyncllm.errors import DeviceError


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, max_useful_blocks: int, extra_bytes: int = 0) -> int:
    """Blocks of `spec` within `budget_bytes`; `extra_bytes`: what each block id holds beside them (a draft
    model's cache: speculative decoding)."""
    per_block = spec.bytes_per_block + extra_bytes
    num = min(budget_bytes // per_block, max_useful_blocks)
    if num < 1:
        raise DeviceError(
            f"no memory left for the KV cache (one block needs {per_block} bytes, "
            f"{budget_bytes} available): raise gpu_memory_utilization or ASYNCLLM_CPU_KVCACHE_SPACE, "
            "or set num_kv_blocks"
        )
    return int(num)


# The CPU default's bounds, in bytes: at most the budget that used to be the default for every model; at least
# a quarter GiB, so that a small model with a short context still batches many sequences.
CPU_KV_DEFAULT_MAX = 2**30
CPU_KV_DEFAULT_MIN = 2**28


def cpu_kv_blocks(
    spec: KVCacheSpec, budget_gib: float | None, max_model_len: int, max_useful_blocks: int, extra_bytes: int = 0
) -> int:
    """The CPU block count: `budget_gib` of blocks, or by default room for one `max_model_len` sequence (a
    prompt up to the model's limit is served; shorter ones share it), within [1/4, 1] GiB. A cache smaller
    than one full sequence refuses longer prompts at once (InvalidRequestError naming its size), never
    mid-generation, and the worker warns about it when the engine starts. `extra_bytes`: as `blocks_for_budget`'s."""
    if budget_gib is not None:
        return blocks_for_budget(spec, int(budget_gib * 2**30), max_useful_blocks, extra_bytes)
    one_sequence = -(-max_model_len // spec.block_size) * (spec.bytes_per_block + extra_bytes)
    budget = min(max(one_sequence, CPU_KV_DEFAULT_MIN), CPU_KV_DEFAULT_MAX)
    return blocks_for_budget(spec, budget, max_useful_blocks, extra_bytes)


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key, value), each [num_blocks, block_size, num_kv_heads, head_dim]: views of one allocation,
    layer after layer.

    Zero-filled: the torch reference reads padded rows under a mask, and 0 * NaN from garbage memory would
    still poison the result. On CPU the zeros are an anonymous mapping's: the kernel backs a page only when it
    is first written, so the cache costs resident memory as blocks fill, and nothing at start-up (torch.zeros
    writes every byte: ~3 s and 1 GiB resident for the old 1 GiB default).
    """
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if device.type == "cpu":
        return _zero_pages_cache(spec, shape)
    # One allocation for every layer, as on CPU: the host tier moves a block of every layer in one strided copy
    # (kv_host.py), not one launch a layer.
    flat = torch.zeros((2 * spec.num_layers, *shape), dtype=spec.dtype, device=device)
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(spec.num_layers)]


def _zero_pages_cache(spec: KVCacheSpec, shape: tuple[int, int, int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One anonymous mapping for every layer's keys and values: the kernel's zero pages until written. Small
    pages only: with transparent huge pages a first write would commit 2 MiB of each of the 2 x num_layers
    tensors at once (numpy's calloc asks for huge pages: +118 MiB for SmolLM2's first token)."""
    per_tensor = spec.bytes_per_block // (2 * spec.num_layers) * shape[0]
    size = 2 * spec.num_layers * per_tensor
    if hasattr(mmap, "MAP_PRIVATE"):  # POSIX: private, not the default shared (shmem-backed) mapping
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        buffer = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    # The tensors hold the mapping (through its buffer) and free it with the last of them.
    flat = torch.frombuffer(buffer, dtype=torch.uint8).view(spec.dtype).view(2 * spec.num_layers, *shape)
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(spec.num_layers)]
