"""Sizing and allocating the paged KV cache.

On CUDA the cache takes what `gpu_memory_utilization` leaves after weights and a profiled peak activation;
on CPU a fixed budget. Either way it is capped at what `max_num_seqs` full-length sequences could use.
"""

from __future__ import annotations

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


def blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, max_useful_blocks: int) -> int:
    num = min(budget_bytes // spec.bytes_per_block, max_useful_blocks)
    if num < 1:
        raise DeviceError(
            f"no memory left for the KV cache (one block needs {spec.bytes_per_block} bytes, "
            f"{budget_bytes} available): raise gpu_memory_utilization or cpu_kv_cache_gib, or set num_kv_blocks"
        )
    return int(num)


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key, value), each [num_blocks, block_size, num_kv_heads, head_dim].

    Zero-filled: the torch reference reads padded rows under a mask, and 0 * NaN from garbage memory would
    still poison the result.
    """
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [
        (
            torch.zeros(shape, dtype=spec.dtype, device=device),
            torch.zeros(shape, dtype=spec.dtype, device=device),
        )
        for _ in range(spec.num_layers)
    ]
