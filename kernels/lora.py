"""Batched LoRA in Triton: many adapters (and tokens with none) in one batch, as Punica/S-LoRA do it.

`lora_add` adds each row's adapter's x @ A[slot]^T @ B[slot]^T into the layer's output in place. Tokens are
grouped by slot into blocks of `LORA_BLOCK_M` rows on the host (`plan_lora_blocks`, lora_plan.py), so each
program multiplies one block of rows by one slot's weights as a matrix tile. Two paths, picked from shapes
by `plan_lora_launch`: "fused", one launch whose programs each shrink their block (the rank-R intermediate
stays in registers) and expand it into one or more column tiles of one shard; "split", a shrink split over K
(partial sums in float32, no atomics) then an expand that sums them. `lora_ref` (lora_ref.py) is the
specification: weights' layout, zero-padded rank, packed shards. `LoRAAdd` is `lora_add` for one layer's
weights, each shape of call checked and planned once (a step too large for the CUDA graphs launches every
layer's from Python).

CUDA-graph safe: the grid depends only on the row count, the slots and the shapes (`max_lora_blocks`); which
rows and slots a step uses is read from the block tables on the device, and programs of unused blocks (slot
-1) exit at once. Knows nothing of models or adapters' files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from .lora_checks import check_a, check_b, check_blocks, check_split
from .lora_plan import (
    FUSED_WARPS,
    LORA_BLOCK_M,
    MAX_SPLITS,
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
    "LoRAAdd",
    "LoRALaunch",
    "LoRAPath",
    "lora_add",
    "lora_ref",
    "max_lora_blocks",
    "plan_lora_blocks",
    "plan_lora_launch",
    "token_slots",
]

# The expand loads every partial sum at once (MAX_SPLITS of [16, R] float32: R registers a thread at 4 warps) up
# to rank 64; past it they spill (ptxas for sm_90: 12 KB of stack at rank 512), so it loads them in turn.
UNROLLED_SPLIT_COLUMNS = 8 * 64


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
def _program_columns(pid_n, N0, N1, N2, NB0, NB1, span):
    """(shard, the shard's first column, the program's first column within it, the shard's width) of column
    program `pid_n`: each program takes `span` columns of one shard, programs go shard by shard."""
    in1 = (pid_n >= NB0).to(tl.int32)  # past shard 0's programs
    in2 = (pid_n >= NB0 + NB1).to(tl.int32)  # past shard 1's
    first_program = in1 * NB0 + in2 * NB1
    shard_col = in1 * N0 + in2 * N1
    width = N0 + in1 * (N1 - N0) + in2 * (N2 - N1)
    return in1 + in2, shard_col, (pid_n - first_program) * span, width


@triton.jit
def _load_tile(
    b_ptr, y_ptr, rows, valid, slot, shard_col, start, end, stride_bs, stride_bn, stride_y,
    R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """B[slot]'s rank columns for the shard's columns [start, start + BLOCK_N) ([R, N_blk], masked from `end`)
    and y's rows there ([M, N_blk])."""
    offs_n = start + tl.arange(0, BLOCK_N)
    cols = (shard_col + offs_n).to(tl.int64)
    n_ok = offs_n < end
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    bt = tl.load(b_base + cols[None, :] * stride_bn + tl.arange(0, R)[:, None], mask=n_ok[None, :], other=0.0)
    y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=valid[:, None] & n_ok[None, :], other=0.0)
    return bt, y


@triton.jit
def _add_tile(
    h, bt, y, y_ptr, rows, valid, shard_col, start, end, stride_y, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Stores y + h [M, R] (rounded to B's dtype, as PEFT rounds lora_A's output) @ bt over the tile that
    `_load_tile` loaded at `start`."""
    acc = tl.dot(h.to(bt.dtype), bt, input_precision=DOT_PRECISION)  # [M, N_blk]
    offs_n = start + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + rows[:, None] * stride_y + (shard_col + offs_n)[None, :]
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=valid[:, None] & (offs_n < end)[None, :])


# One compiled kernel for any count of column tiles a program (and so of programs a shard): a prompt step too
# large for the graphs compiles nothing the warm-up's small launches did not.
@triton.jit(do_not_specialize=["tiles", "NB0", "NB1"])
def _lora_fused_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, tokens_ptr, slots_ptr, K, tiles,
    stride_x, stride_as, stride_ar, stride_bs, stride_bn, stride_y, N0, N1, N2, NB0, NB1,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    slot = tl.load(slots_ptr + block)
    if slot < 0:
        return
    span = BLOCK_N * tiles
    shard, shard_col, start, width = _program_columns(tl.program_id(1), N0, N1, N2, NB0, NB1, span)
    end = tl.minimum(width, start + span)  # the program's columns of its shard: `tiles` tiles of BLOCK_N
    rows, valid = _block_rows(tokens_ptr, block, BLOCK_M)
    # The first tile's B and y are loaded before the shrink, each next tile's before the last one is stored:
    # their latency hides behind the work in between (at decode sizes a launch is mostly latency).
    bt, y = _load_tile(
        b_ptr, y_ptr, rows, valid, slot, shard_col, start, end, stride_bs, stride_bn, stride_y, R, BLOCK_N
    )  # fmt: skip
    h = _shrink_rows(
        x_ptr, a_ptr, rows, valid, slot, shard, 0, K, stride_x, stride_as, stride_ar, R, BLOCK_M, BLOCK_K,
        DOT_PRECISION,
    )  # fmt: skip
    for j in range(tiles):
        here = start + j * BLOCK_N
        bt_next, y_next = _load_tile(
            b_ptr, y_ptr, rows, valid, slot, shard_col, here + BLOCK_N, end, stride_bs, stride_bn, stride_y, R,
            BLOCK_N,
        )  # fmt: skip
        _add_tile(h, bt, y, y_ptr, rows, valid, shard_col, here, end, stride_y, BLOCK_N, DOT_PRECISION)
        bt, y = bt_next, y_next


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
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    slot = tl.load(slots_ptr + block)
    if slot < 0:
        return
    shard, shard_col, start, width = _program_columns(tl.program_id(1), N0, N1, N2, NB0, NB1, BLOCK_N)
    rows, valid = _block_rows(tokens_ptr, block, BLOCK_M)
    bt, y = _load_tile(
        b_ptr, y_ptr, rows, valid, slot, shard_col, start, width, stride_bs, stride_bn, stride_y, R, BLOCK_N
    )  # fmt: skip
    h_ptrs = h_ptr + rows[:, None] * stride_h + (shard * R + tl.arange(0, R))[None, :]  # [M, R]
    h = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    if UNROLL_SPLITS > 1:  # the shrink's partial sums over K, unrolled: their loads go out together
        for s in tl.static_range(UNROLL_SPLITS):
            in_split = tl.full([1, R], s, tl.int32) < splits
            h += tl.load(h_ptrs + s * stride_hs, mask=valid[:, None] & in_split, other=0.0)
    else:  # too wide a rank to hold them all in registers: one after another
        for s in range(splits):
            h += tl.load(h_ptrs + s * stride_hs, mask=valid[:, None], other=0.0)
    _add_tile(h, bt, y, y_ptr, rows, valid, shard_col, start, width, stride_y, BLOCK_N, DOT_PRECISION)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # no TF32 rounding for float32 inputs


def _columns(sizes: list[int], span: int) -> tuple[dict[str, int], int]:
    """The column arguments of a kernel whose programs each take `span` columns of one shard (shard widths,
    programs per shard) and its column programs in all."""
    n0, n1, n2 = [*sizes, 0, 0][:3]
    nb0, nb1, nb2 = (-(-n // span) for n in (n0, n1, n2))
    return dict(N0=n0, N1=n1, N2=n2, NB0=nb0, NB1=nb1), nb0 + nb1 + nb2


Launcher = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]  # (x or h, y, tokens, slots)


def _shrink_launcher(
    x: torch.Tensor, a: torch.Tensor, h: torch.Tensor, num_blocks: int, num_shards: int, rank: int, launch: LoRALaunch
) -> Launcher:
    """Launches the shrink of x's shape into h's (x, h and the block tables given at each call)."""
    grid = (num_blocks, num_shards * launch.splits)
    ints = (x.shape[1], launch.k_chunk, x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1))
    consts = dict(NUM_SHARDS=num_shards, R=rank, BLOCK_M=LORA_BLOCK_M, BLOCK_K=launch.block_k)
    consts |= dict(DOT_PRECISION=_precision(x.dtype), num_warps=SPLIT_WARPS)

    def run(x: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        _lora_shrink_kernel[grid](x, a, h, tokens, slots, *ints, **consts)

    return run


def _expand_launcher(
    parts: torch.Tensor, b: torch.Tensor, y: torch.Tensor, num_blocks: int, sizes: list[int], launch: LoRALaunch
) -> Launcher:
    """Launches the expand of partial sums of `parts`' shape into y's shape."""
    columns, programs = _columns(sizes, launch.block_n)
    grid = (num_blocks, programs)
    ints = (parts.shape[0], parts.stride(0), parts.stride(1), b.stride(0), b.stride(1), y.stride(0))
    rank = b.shape[2]
    unroll = MAX_SPLITS if rank * MAX_SPLITS <= UNROLLED_SPLIT_COLUMNS else 1
    consts = columns | dict(R=rank, BLOCK_M=LORA_BLOCK_M, BLOCK_N=launch.block_n, UNROLL_SPLITS=unroll)
    consts |= dict(DOT_PRECISION=_precision(y.dtype), num_warps=SPLIT_WARPS)

    def run(parts: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        _lora_expand_kernel[grid](parts, b, y, tokens, slots, *ints, **consts)

    return run


def _add_launcher(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    block_tokens: torch.Tensor,
    block_slot: torch.Tensor,
    sizes: list[int],
    launch: LoRALaunch | None,
    path: LoRAPath | None,
) -> Launcher:
    """Checks everything `lora_add` is given and returns what launches it for tensors of the same shapes,
    strides and dtypes (x, y and the block tables given at each call)."""
    check_b(b, y, sizes, x.shape[0])
    rank = check_a(x, a, len(sizes))
    if rank != b.shape[2]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} disagree on the rank over {len(sizes)} shards")
    num_tokens, k = x.shape
    check_blocks(block_tokens, block_slot, num_tokens, a.shape[0])
    if launch is None:
        launch = plan_lora_launch(num_tokens, a.shape[0], k, sizes, rank, x.element_size(), path)
    blocks = max_lora_blocks(num_tokens, a.shape[0])
    if num_tokens == 0:
        return lambda x, y, tokens, slots: None
    if launch.path == "split":
        check_split(launch, k)
        h_shape = (launch.splits, num_tokens, a.shape[1])
        h = torch.empty(h_shape, dtype=torch.float32, device="meta")  # its strides, for the launchers
        shrink = _shrink_launcher(x, a, h, blocks, len(sizes), rank, launch)
        expand = _expand_launcher(h, b, y, blocks, sizes, launch)

        def split(x: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
            h = torch.empty(h_shape, dtype=torch.float32, device=x.device)
            shrink(x, h, tokens, slots)
            expand(h, y, tokens, slots)

        return split
    if launch.k_chunk < k:
        raise ValueError(f"{launch} does not cover K={k}: the fused path takes K whole")
    columns, programs = _columns(sizes, launch.block_n * launch.tiles)
    grid = (blocks, programs)
    ints = (k, launch.tiles, x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1), y.stride(0))
    consts = columns | dict(R=rank, BLOCK_M=LORA_BLOCK_M, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k)
    consts |= dict(DOT_PRECISION=_precision(x.dtype), num_warps=FUSED_WARPS)

    def fused(x: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        _lora_fused_kernel[grid](x, a, b, y, tokens, slots, *ints, **consts)

    return fused


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
    _add_launcher(x, y, a, b, block_tokens, block_slot, list(shard_sizes), launch, path)(x, y, block_tokens, block_slot)
    return y


class LoRAAdd:
    """`lora_add` for one layer's adapters (`a`, `b` and `shard_sizes` fixed): each shape of call is checked
    and planned once, so an eager step's call is a lookup and the launch. Not thread-safe (one step thread)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, shard_sizes: Sequence[int]) -> None:
        self.a, self.b, self.sizes = a, b, list(shard_sizes)
        # (x's and y's shapes, strides and dtypes, the path forced) -> (the launcher, the block tables checked)
        self._launchers: dict[tuple[object, ...], tuple[Launcher, torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        block_tokens: torch.Tensor,
        block_slot: torch.Tensor,
        path: LoRAPath | None = None,
    ) -> torch.Tensor:
        key = (x.shape, x.stride(), x.dtype, y.shape, y.stride(), y.dtype, path)
        known = self._launchers.get(key)
        if known is None or known[1] is not block_tokens or known[2] is not block_slot:
            launcher = _add_launcher(x, y, self.a, self.b, block_tokens, block_slot, self.sizes, None, path)
            known = self._launchers[key] = (launcher, block_tokens, block_slot)
        known[0](x, y, block_tokens, block_slot)
        return y
