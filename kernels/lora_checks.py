"""The batched LoRA launchers' input contract (kernels/lora.py): shapes, dtypes, strides, block tables and
launches, checked on the host before any launch, each failure naming the argument. Imports only torch and
the plan.
"""

from __future__ import annotations

import torch

from .lora_plan import LoRALaunch, max_lora_blocks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SHARDS = 3  # q/k/v


def check_blocks(block_tokens: torch.Tensor, block_slot: torch.Tensor, num_tokens: int, num_slots: int) -> None:
    for name, t in (("block_tokens", block_tokens), ("block_slot", block_slot)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 tensor; got {t.dtype} of shape {tuple(t.shape)}")
    grid = max_lora_blocks(num_tokens, num_slots)
    if block_slot.numel() < grid:
        raise ValueError(
            f"block_slot has {block_slot.numel()} entries; {num_tokens} rows over {num_slots} slots need {grid}"
        )


def check_rank(rank: int) -> None:
    if rank < 16 or rank & (rank - 1):
        raise ValueError(f"the padded rank must be a power of two >= 16 (a Triton dot's smallest tile); got {rank}")


def check_a(x: torch.Tensor, a: torch.Tensor, num_shards: int) -> int:
    """The padded rank, once x [T, K] and a [slots, S * R, K] are checked."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"x [T, K] and a [slots, S * R, K] disagree: {tuple(x.shape)} and {tuple(a.shape)}")
    if x.dtype not in DTYPES or a.dtype != x.dtype:
        raise TypeError(f"x and a must share a float dtype; got {x.dtype} and {a.dtype}")
    if not 1 <= num_shards <= MAX_SHARDS or a.shape[1] % num_shards:
        raise ValueError(f"num_shards={num_shards} does not divide a's {a.shape[1]} rank rows (1..{MAX_SHARDS})")
    if x.stride(1) != 1 or a.stride(2) != 1:
        raise ValueError("x and a must be contiguous in their last dim")
    rank = a.shape[1] // num_shards
    check_rank(rank)
    return rank


def check_b(b: torch.Tensor, y: torch.Tensor, sizes: list[int], num_rows: int) -> None:
    if not 1 <= len(sizes) <= MAX_SHARDS or sum(sizes) != y.shape[1] or min(sizes) < 1:
        raise ValueError(f"shard_sizes {sizes} must be 1..{MAX_SHARDS} positive sizes summing to y's {y.shape[1]}")
    if b.dim() != 3 or b.shape[1] != y.shape[1] or y.shape[0] != num_rows:
        raise ValueError(f"b {tuple(b.shape)} and y {tuple(y.shape)} disagree ({num_rows} rows)")
    if y.dtype not in DTYPES or b.dtype != y.dtype:
        raise TypeError(f"b and y must share a float dtype; got {b.dtype} and {y.dtype}")
    if b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("b and y must be contiguous in their last dim")
    check_rank(b.shape[2])


def check_split(launch: LoRALaunch, k: int) -> None:
    if launch.path != "split":
        raise ValueError(f"{launch} is no split launch")
    if launch.splits * launch.k_chunk < k:
        raise ValueError(f"{launch} does not cover K={k}: splits * k_chunk must reach it")
