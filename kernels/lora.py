"""Batched LoRA in Triton: many adapters (and tokens with none) in one batch, as Punica/S-LoRA do it.

`lora_shrink` computes h = x @ A[slot]^T for each token's adapter slot, `lora_expand` adds h @ B[slot]^T into
the layer's output in place; `lora_add` runs both. Tokens are grouped by slot into blocks of `LORA_BLOCK_M`
rows on the host (`plan_lora_blocks`, lora_plan.py, re-exported here), so each program multiplies one block
of rows by one slot's weights as a matrix tile. `lora_ref` (lora_ref.py) is the specification: weights'
layout, zero-padded rank, packed shards.

CUDA-graph safe: the grid depends only on the row count and the number of slots (`max_lora_blocks`); which
rows and slots a step uses is read from the block tables on the device, and programs of unused blocks (slot
-1) exit at once. Knows nothing of models or adapters' files.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .lora_plan import LORA_BLOCK_M, max_lora_blocks, plan_lora_blocks, token_slots
from .lora_ref import lora_ref

__all__ = [
    "LORA_BLOCK_M",
    "lora_add",
    "lora_expand",
    "lora_ref",
    "lora_shrink",
    "max_lora_blocks",
    "plan_lora_blocks",
    "token_slots",
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SHARDS = 3  # q/k/v


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, tokens_ptr, slots_ptr, K,
    stride_x, stride_as, stride_ar, stride_h,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    shard = tl.program_id(1)
    slot = tl.load(slots_ptr + block)
    if slot < 0:
        return
    tok = tl.load(tokens_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [M] rows of x, -1 past the slot's
    valid = tok >= 0
    rows = tl.where(valid, tok, 0).to(tl.int64)
    offs_r = shard * R + tl.arange(0, R)  # this shard's rank rows of A
    a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :].to(tl.int64) * stride_ar  # [1, R]
    acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_base + offs_k[:, None], mask=k_ok[:, None], other=0.0)  # [K_blk, R]
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
    tl.store(h_ptr + rows[:, None] * stride_h + offs_r[None, :], acc, mask=valid[:, None])


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, tokens_ptr, slots_ptr,
    stride_h, stride_bs, stride_bn, stride_y,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, NB0: tl.constexpr, NB1: tl.constexpr,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    pid_n = tl.program_id(1)  # output column blocks, shard by shard: no block straddles two shards
    slot = tl.load(slots_ptr + block)
    if slot < 0:
        return
    in1 = (pid_n >= NB0).to(tl.int32)  # past shard 0's blocks
    in2 = (pid_n >= NB0 + NB1).to(tl.int32)  # past shard 1's
    shard = in1 + in2
    first_block = in1 * NB0 + in2 * NB1
    first_col = in1 * N0 + in2 * N1
    width = N0 + in1 * (N1 - N0) + in2 * (N2 - N1)
    offs_n = (pid_n - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    cols = first_col + offs_n
    tok = tl.load(tokens_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = tok >= 0
    rows = tl.where(valid, tok, 0).to(tl.int64)
    offs_r = tl.arange(0, R)
    ht = tl.load(h_ptr + rows[:, None] * stride_h + (shard * R + offs_r)[None, :], mask=valid[:, None], other=0.0)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    bt = tl.load(b_base + cols[None, :].to(tl.int64) * stride_bn + offs_r[:, None], mask=n_ok[None, :], other=0.0)
    acc = tl.dot(ht.to(bt.dtype), bt, input_precision=DOT_PRECISION)  # [M, N_blk]
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    y_mask = valid[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=y_mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # no TF32 rounding for float32 inputs


def _check_blocks(block_tokens: torch.Tensor, block_slot: torch.Tensor, num_tokens: int, num_slots: int) -> None:
    for name, t in (("block_tokens", block_tokens), ("block_slot", block_slot)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 tensor; got {t.dtype} of shape {tuple(t.shape)}")
    grid = max_lora_blocks(num_tokens, num_slots)
    if block_slot.numel() < grid:
        raise ValueError(
            f"block_slot has {block_slot.numel()} entries; {num_tokens} rows over {num_slots} slots need {grid}"
        )


def _check_rank(rank: int) -> None:
    if rank < 16 or rank & (rank - 1):
        raise ValueError(f"the padded rank must be a power of two >= 16 (a Triton dot's smallest tile); got {rank}")


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [slots, num_shards * R, K]; the slot dim may be strided (a view of a pool)
    block_tokens: torch.Tensor,  # int32, from plan_lora_blocks
    block_slot: torch.Tensor,  # int32, at least max_lora_blocks(T, slots) entries
    num_shards: int,
    out: torch.Tensor | None = None,  # [T, num_shards * R] float32
) -> torch.Tensor:
    """h = x @ a[slot]^T for the rows the blocks name (other rows of `out` are left as they are)."""
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"x [T, K] and a [slots, S * R, K] disagree: {tuple(x.shape)} and {tuple(a.shape)}")
    if x.dtype not in DTYPES or a.dtype != x.dtype:
        raise TypeError(f"x and a must share a float dtype; got {x.dtype} and {a.dtype}")
    if not 1 <= num_shards <= MAX_SHARDS or a.shape[1] % num_shards:
        raise ValueError(f"num_shards={num_shards} does not divide a's {a.shape[1]} rank rows (1..{MAX_SHARDS})")
    if x.stride(1) != 1 or a.stride(2) != 1:
        raise ValueError("x and a must be contiguous in their last dim")
    rank = a.shape[1] // num_shards
    _check_rank(rank)
    num_tokens, k = x.shape
    _check_blocks(block_tokens, block_slot, num_tokens, a.shape[0])
    if out is None:
        out = torch.empty(num_tokens, a.shape[1], dtype=torch.float32, device=x.device)
    elif out.shape != (num_tokens, a.shape[1]) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{num_tokens}, {a.shape[1]}] with unit last stride")
    if num_tokens == 0:
        return out
    block_k = max(16, min(128, triton.next_power_of_2(k)))
    grid = (max_lora_blocks(num_tokens, a.shape[0]), num_shards)
    _lora_shrink_kernel[grid](
        x, a, out, block_tokens, block_slot, k, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        R=rank, BLOCK_M=LORA_BLOCK_M, BLOCK_K=block_k, DOT_PRECISION=_precision(x.dtype),
    )  # fmt: skip
    return out


def lora_expand(
    h: torch.Tensor,  # [T, num_shards * R] float32
    b: torch.Tensor,  # [slots, N, R]; the slot dim may be strided
    y: torch.Tensor,  # [T, N], updated in place
    block_tokens: torch.Tensor,
    block_slot: torch.Tensor,
    shard_sizes: Sequence[int],  # summing to N
) -> torch.Tensor:
    """y[t, shard i] += h[t, rank block i] @ b[slot, shard i]^T for the rows the blocks name; returns `y`."""
    sizes = list(shard_sizes)
    if not 1 <= len(sizes) <= MAX_SHARDS or sum(sizes) != y.shape[1] or min(sizes) < 1:
        raise ValueError(f"shard_sizes {sizes} must be 1..{MAX_SHARDS} positive sizes summing to y's {y.shape[1]}")
    if b.dim() != 3 or b.shape[1] != y.shape[1] or h.shape != (y.shape[0], len(sizes) * b.shape[2]):
        raise ValueError(f"h {tuple(h.shape)}, b {tuple(b.shape)} and y {tuple(y.shape)} disagree")
    if y.dtype not in DTYPES or b.dtype != y.dtype or h.dtype != torch.float32:
        raise TypeError(f"b and y must share a float dtype and h be float32; got {b.dtype}, {y.dtype}, {h.dtype}")
    if h.stride(1) != 1 or b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("h, b and y must be contiguous in their last dim")
    rank = b.shape[2]
    _check_rank(rank)
    _check_blocks(block_tokens, block_slot, y.shape[0], b.shape[0])
    if y.shape[0] == 0:
        return y
    block_n = max(16, min(64, triton.next_power_of_2(max(sizes))))
    n0, n1, n2 = [*sizes, 0, 0][:3]
    nb0, nb1, nb2 = (-(-n // block_n) for n in (n0, n1, n2))
    grid = (max_lora_blocks(y.shape[0], b.shape[0]), nb0 + nb1 + nb2)
    _lora_expand_kernel[grid](
        h, b, y, block_tokens, block_slot, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        N0=n0, N1=n1, N2=n2, NB0=nb0, NB1=nb1, R=rank, BLOCK_M=LORA_BLOCK_M, BLOCK_N=block_n,
        DOT_PRECISION=_precision(y.dtype),
    )  # fmt: skip
    return y


def lora_add(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    block_tokens: torch.Tensor,
    block_slot: torch.Tensor,
    shard_sizes: Sequence[int],
) -> torch.Tensor:
    """`lora_ref`'s y += x @ A[slot]^T @ B[slot]^T, over the blocks of `plan_lora_blocks`; returns `y`."""
    h = lora_shrink(x, a, block_tokens, block_slot, len(shard_sizes))
    return lora_expand(h, b, y, block_tokens, block_slot, shard_sizes)
