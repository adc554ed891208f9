"""Batched LoRA in Triton: many adapters (and tokens with none) in one batch, as Punica/S-LoRA do it.

`lora_add` adds each row's adapter's x @ A[slot]^T @ B[slot]^T into the layer's output in place. Tokens are
grouped by slot into blocks of `LORA_BLOCK_M` rows on the host (`plan_lora_blocks`, lora_plan.py), so each
program multiplies one block of rows by one slot's weights as a matrix tile. Two paths, picked from shapes
by `plan_lora_launch`: "fused", one launch whose programs each shrink their block (the rank-R intermediate
stays in registers) and expand it into one column tile; "split", a shrink split over K (`lora_shrink`, partial
sums in float32, no atomics) then an expand that sums them (`lora_expand`). `lora_ref` (lora_ref.py) is the
specification: weights' layout, zero-padded rank, packed shards.

CUDA-graph safe: the grid depends only on the row count, the slots and the shapes (`max_lora_blocks`); which
rows and slots a step uses is read from the block tables on the device, and programs of unused blocks (slot
-1) exit at once. Knows nothing of models or adapters' files.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .lora_plan import (
    FUSED_WARPS,
    LORA_BLOCK_M,
    SPLIT_WARPS,
    LoRALaunch,
    LoRAPath,
    max_lora_blocks,
    plan_lora_blocks,
    plan_lora_launch,
    token_slots,
)
from .lora_ref import lora_ref

__all__ = [
    "LORA_BLOCK_M",
    "LoRALaunch",
    "LoRAPath",
    "lora_add",
    "lora_expand",
    "lora_ref",
    "lora_shrink",
    "max_lora_blocks",
    "plan_lora_blocks",
    "plan_lora_launch",
    "token_slots",
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SHARDS = 3  # q/k/v
_planned = functools.lru_cache(maxsize=4096)(plan_lora_launch)  # a few shapes per model, every step eager


@triton.jit
def _block_rows(tokens_ptr, block, BLOCK_M: tl.constexpr):
    tok = tl.load(tokens_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [M] rows of x, -1 past the slot's
    valid = tok >= 0
    return tl.where(valid, tok, 0).to(tl.int64), valid


@triton.jit
def _shrink_rows(
    x_ptr, a_ptr, rows, valid, slot, shard, k_start, k_end, stride_x, stride_as, stride_ar,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """[M, R] float32: the block's rows of x times shard `shard`'s rank rows of A[slot], over K [k_start, k_end).
    A step's loads go out together (cp.async on sm_90) and the step waits for them: wide K tiles, few steps."""
    offs_r = shard * R + tl.arange(0, R)
    a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :].to(tl.int64) * stride_ar  # [1, R]
    x_base = x_ptr + rows[:, None] * stride_x  # [M, 1]
    acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        xt = tl.load(x_base + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)  # [M, K_blk]
        at = tl.load(a_base + offs_k[:, None], mask=k_ok[:, None], other=0.0)  # [K_blk, R]
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _tile_columns(pid_n, N0, N1, N2, NB0, NB1, BLOCK_N: tl.constexpr):
    """(shard, columns, in-shard mask) of column tile `pid_n`: tiles go shard by shard, none straddles two."""
    in1 = (pid_n >= NB0).to(tl.int32)  # past shard 0's tiles
    in2 = (pid_n >= NB0 + NB1).to(tl.int32)  # past shard 1's
    first_tile = in1 * NB0 + in2 * NB1
    first_col = in1 * N0 + in2 * N1
    width = N0 + in1 * (N1 - N0) + in2 * (N2 - N1)
    offs_n = (pid_n - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)
    return in1 + in2, first_col + offs_n, offs_n < width


@triton.jit
def _expand_into(
    h, b_ptr, y_ptr, rows, valid, slot, cols, n_ok, stride_bs, stride_bn, stride_y,
    R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """y[rows, cols] += h [M, R] (rounded to B's dtype, as PEFT rounds lora_A's output) @ B[slot, cols]^T."""
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    offs_r = tl.arange(0, R)
    bt = tl.load(b_base + cols[None, :].to(tl.int64) * stride_bn + offs_r[:, None], mask=n_ok[None, :], other=0.0)
    acc = tl.dot(h.to(bt.dtype), bt, input_precision=DOT_PRECISION)  # [M, N_blk]
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    y_mask = valid[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=y_mask)


@triton.jit
def _lora_fused_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, tokens_ptr, slots_ptr, K,
    stride_x, stride_as, stride_ar, stride_bs, stride_bn, stride_y, N0, N1, N2, NB0, NB1,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    slot = tl.load(slots_ptr + block)
    if slot < 0:
        return
    shard, cols, n_ok = _tile_columns(tl.program_id(1), N0, N1, N2, NB0, NB1, BLOCK_N)
    rows, valid = _block_rows(tokens_ptr, block, BLOCK_M)
    h = _shrink_rows(
        x_ptr, a_ptr, rows, valid, slot, shard, 0, K, stride_x, stride_as, stride_ar, R, BLOCK_M, BLOCK_K,
        DOT_PRECISION,
    )  # fmt: skip
    _expand_into(h, b_ptr, y_ptr, rows, valid, slot, cols, n_ok, stride_bs, stride_bn, stride_y, R, DOT_PRECISION)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, tokens_ptr, slots_ptr, K, k_chunk,
    stride_x, stride_as, stride_ar, stride_hs, stride_h,
    NUM_SHARDS: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    slot = tl.load(slots_ptr + block)
    if slot < 0:
        return
    shard = tl.program_id(1) % NUM_SHARDS
    split = tl.program_id(1) // NUM_SHARDS
    k_start = split * k_chunk
    rows, valid = _block_rows(tokens_ptr, block, BLOCK_M)
    acc = _shrink_rows(
        x_ptr, a_ptr, rows, valid, slot, shard, k_start, tl.minimum(K, k_start + k_chunk), stride_x, stride_as,
        stride_ar, R, BLOCK_M, BLOCK_K, DOT_PRECISION,
    )  # fmt: skip
    offs_r = shard * R + tl.arange(0, R)
    tl.store(h_ptr + split * stride_hs + rows[:, None] * stride_h + offs_r[None, :], acc, mask=valid[:, None])


@triton.jit(do_not_specialize=["splits"])  # one compiled expand for every split count
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, tokens_ptr, slots_ptr, splits,
    stride_hs, stride_h, stride_bs, stride_bn, stride_y, N0, N1, N2, NB0, NB1,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    slot = tl.load(slots_ptr + block)
    if slot < 0:
        return
    shard, cols, n_ok = _tile_columns(tl.program_id(1), N0, N1, N2, NB0, NB1, BLOCK_N)
    rows, valid = _block_rows(tokens_ptr, block, BLOCK_M)
    h_ptrs = h_ptr + rows[:, None] * stride_h + (shard * R + tl.arange(0, R))[None, :]  # [M, R]
    h = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    for s in range(splits):  # the shrink's partial sums over K
        h += tl.load(h_ptrs + s * stride_hs, mask=valid[:, None], other=0.0)
    _expand_into(h, b_ptr, y_ptr, rows, valid, slot, cols, n_ok, stride_bs, stride_bn, stride_y, R, DOT_PRECISION)


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


def _check_a(x: torch.Tensor, a: torch.Tensor, num_shards: int) -> int:
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
    _check_rank(rank)
    return rank


def _check_b(b: torch.Tensor, y: torch.Tensor, sizes: list[int], num_rows: int) -> None:
    if not 1 <= len(sizes) <= MAX_SHARDS or sum(sizes) != y.shape[1] or min(sizes) < 1:
        raise ValueError(f"shard_sizes {sizes} must be 1..{MAX_SHARDS} positive sizes summing to y's {y.shape[1]}")
    if b.dim() != 3 or b.shape[1] != y.shape[1] or y.shape[0] != num_rows:
        raise ValueError(f"b {tuple(b.shape)} and y {tuple(y.shape)} disagree ({num_rows} rows)")
    if y.dtype not in DTYPES or b.dtype != y.dtype:
        raise TypeError(f"b and y must share a float dtype; got {b.dtype} and {y.dtype}")
    if b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("b and y must be contiguous in their last dim")
    _check_rank(b.shape[2])


def _column_tiles(sizes: list[int], block_n: int) -> tuple[dict[str, int], int]:
    """The column-tile arguments of a kernel (shard widths, tiles per shard) and the tile count."""
    n0, n1, n2 = [*sizes, 0, 0][:3]
    nb0, nb1, nb2 = (-(-n // block_n) for n in (n0, n1, n2))
    return dict(N0=n0, N1=n1, N2=n2, NB0=nb0, NB1=nb1), nb0 + nb1 + nb2


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [slots, num_shards * R, K]; the slot dim may be strided (a view of a pool)
    block_tokens: torch.Tensor,  # int32, from plan_lora_blocks
    block_slot: torch.Tensor,  # int32, at least max_lora_blocks(T, slots) entries
    num_shards: int,
    launch: LoRALaunch | None = None,  # a "split" launch; None: plan_lora_launch's
) -> torch.Tensor:
    """[splits, T, num_shards * R] float32 partial sums over K of x @ a[slot]^T (their sum is h), for the rows
    the blocks name (other rows are left unwritten)."""
    rank = _check_a(x, a, num_shards)
    num_tokens, k = x.shape
    _check_blocks(block_tokens, block_slot, num_tokens, a.shape[0])
    if launch is None:
        launch = plan_lora_launch(num_tokens, a.shape[0], k, [1] * num_shards, rank, x.element_size(), "split")
    if launch.splits * launch.k_chunk < k:
        raise ValueError(f"{launch} does not cover K={k}: splits * k_chunk must reach it")
    out = torch.empty(launch.splits, num_tokens, a.shape[1], dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    grid = (max_lora_blocks(num_tokens, a.shape[0]), num_shards * launch.splits)
    _lora_shrink_kernel[grid](
        x, a, out, block_tokens, block_slot, k, launch.k_chunk, x.stride(0), a.stride(0), a.stride(1),
        out.stride(0), out.stride(1), NUM_SHARDS=num_shards, R=rank, BLOCK_M=LORA_BLOCK_M, BLOCK_K=launch.block_k,
        DOT_PRECISION=_precision(x.dtype), num_warps=SPLIT_WARPS,
    )  # fmt: skip
    return out


def lora_expand(
    h: torch.Tensor,  # [splits, T, num_shards * R] or [T, num_shards * R], float32: summed over splits
    b: torch.Tensor,  # [slots, N, R]; the slot dim may be strided
    y: torch.Tensor,  # [T, N], updated in place
    block_tokens: torch.Tensor,
    block_slot: torch.Tensor,
    shard_sizes: Sequence[int],  # summing to N
    launch: LoRALaunch | None = None,  # its block_n; None: plan_lora_launch's split path
) -> torch.Tensor:
    """y[t, shard i] += h[t, rank block i] @ b[slot, shard i]^T for the rows the blocks name; returns `y`."""
    sizes = list(shard_sizes)
    _check_b(b, y, sizes, y.shape[0])
    parts = h if h.dim() == 3 else h[None]
    if parts.shape[1:] != (y.shape[0], len(sizes) * b.shape[2]) or h.dtype != torch.float32 or h.stride(-1) != 1:
        raise ValueError(f"h {tuple(h.shape)} {h.dtype} must be float32 [splits, T, S * R] for b {tuple(b.shape)}")
    rank = b.shape[2]
    _check_blocks(block_tokens, block_slot, y.shape[0], b.shape[0])
    if launch is None:
        launch = plan_lora_launch(y.shape[0], b.shape[0], 16, sizes, rank, y.element_size(), "split")
    if y.shape[0] == 0:
        return y
    columns, tiles = _column_tiles(sizes, launch.block_n)
    grid = (max_lora_blocks(y.shape[0], b.shape[0]), tiles)
    _lora_expand_kernel[grid](
        parts, b, y, block_tokens, block_slot, parts.shape[0], parts.stride(0), parts.stride(1), b.stride(0),
        b.stride(1), y.stride(0), **columns, R=rank, BLOCK_M=LORA_BLOCK_M, BLOCK_N=launch.block_n,
        DOT_PRECISION=_precision(y.dtype), num_warps=SPLIT_WARPS,
    )  # fmt: skip
    return y


def lora_add(
    x: torch.Tensor,  # [T, K]
    y: torch.Tensor,  # [T, N], updated in place
    a: torch.Tensor,  # [slots, S * R, K]
    b: torch.Tensor,  # [slots, N, R]
    block_tokens: torch.Tensor,
    block_slot: torch.Tensor,
    shard_sizes: Sequence[int],
    launch: LoRALaunch | None = None,  # None: plan_lora_launch's choice for these shapes
    path: LoRAPath | None = None,  # without `launch`: the plan's launch for this path (warming up, benchmarks)
) -> torch.Tensor:
    """`lora_ref`'s y += x @ A[slot]^T @ B[slot]^T, over the blocks of `plan_lora_blocks`; returns `y`."""
    sizes = list(shard_sizes)
    _check_b(b, y, sizes, x.shape[0])
    rank = _check_a(x, a, len(sizes))
    if rank != b.shape[2]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} disagree on the rank over {len(sizes)} shards")
    num_tokens, k = x.shape
    _check_blocks(block_tokens, block_slot, num_tokens, a.shape[0])
    if launch is None:
        launch = _planned(num_tokens, a.shape[0], k, tuple(sizes), rank, x.element_size(), path)
    if launch.path == "split":
        h = lora_shrink(x, a, block_tokens, block_slot, len(sizes), launch)
        return lora_expand(h, b, y, block_tokens, block_slot, sizes, launch)
    if launch.k_chunk < k:
        raise ValueError(f"{launch} does not cover K={k}: the fused path takes K whole")
    if num_tokens == 0:
        return y
    columns, tiles = _column_tiles(sizes, launch.block_n)
    grid = (max_lora_blocks(num_tokens, a.shape[0]), tiles)
    _lora_fused_kernel[grid](
        x, a, b, y, block_tokens, block_slot, k, x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        y.stride(0), **columns, R=rank, BLOCK_M=LORA_BLOCK_M, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        DOT_PRECISION=_precision(x.dtype), num_warps=FUSED_WARPS,
    )  # fmt: skip
    return y
