"""Which work each program of the persistent decode layer (decode_layer_kernels.py) takes, and asking L2 for
what that work reads before its phase: a phase-2 item's row, KV head and keys (`_item_keys`, the attention's and
its prefetch's one map), each program's tiles of a projection (every program-th, as the GEMV phases take them),
the launch's PREFETCH modes (decode_layer_plan.PREFETCH_MODES). Device code only; CUDA only where it prefetches
(PTX), behind constexprs the interpreter never sets.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .l2_prefetch import LINE_BYTES, prefetch_l2, prefetch_span_l2


@triton.jit
def _prefetch_l2(w_ptr, numel, LINES: tl.constexpr, ITEM: tl.constexpr):
    """Asks L2 for this program's share of a weight (`numel` elements of ITEM bytes), one 128-byte line a
    request, without waiting: the weights do not depend on the activations, so HBM can stream them while
    the phases before their use wait on each other."""
    per_line: tl.constexpr = LINE_BYTES // ITEM
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for start in range(pid * LINES, numel // per_line, programs * LINES):
        lines = start + tl.arange(0, LINES)
        prefetch_l2(w_ptr + tl.minimum(lines, numel // per_line - 1).to(tl.int64) * per_line)


@triton.jit
def _prefetch_tiles(w_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, PAIR: tl.constexpr,
                    THREADS: tl.constexpr, PIECES: tl.constexpr):  # fmt: skip
    """Asks L2 for the rows of W [N (x2 with PAIR: gate, then up), K] this program's tiles of BN outputs read
    (every program-th tile, as `_project` and phase 4 take them): contiguous ranges, PIECES bulk requests each."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for tile in range(pid, N // BN, programs):
        first = tile.to(tl.int64) * BN * K
        prefetch_span_l2(w_ptr, first, BN * K, THREADS, PIECES)
        if PAIR:
            prefetch_span_l2(w_ptr, first + N * K, BN * K, THREADS, PIECES)


@triton.jit
def _prefetch_later_tiles(
    o_w_ptr, gate_up_w_ptr, down_w_ptr, HIDDEN: tl.constexpr, INTER: tl.constexpr, Q_SIZE: tl.constexpr,
    BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr, THREADS: tl.constexpr, PIECES: tl.constexpr,
):  # fmt: skip
    """This program's tiles of phases 3-5 (o_proj, gate/up, down), in the order it reads them."""
    _prefetch_tiles(o_w_ptr, HIDDEN, Q_SIZE, BN_O, False, THREADS, PIECES)
    _prefetch_tiles(gate_up_w_ptr, INTER, HIDDEN, BN_GU, True, THREADS, PIECES)
    _prefetch_tiles(down_w_ptr, HIDDEN, INTER, BN_DOWN, False, THREADS, PIECES)


@triton.jit
def _item_keys(item, num_splits, seq_lens_ptr, NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Phase 2's item `item`: (row, KV head, split, the row's seq_len, keys a split, and the split's keys
    [start, end)): splits of whole BLOCK_N tiles; splits past the sequence's end get none (start >= end)."""
    split = item % num_splits
    kv_head = (item // num_splits) % NUM_KV_HEADS
    row = item // (num_splits * NUM_KV_HEADS)
    seq_len = tl.load(seq_lens_ptr + row)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    return row, kv_head, split, seq_len, tokens_per_split, start, end


@triton.jit
def _prefetch_attention_kv(
    num_splits, rows, bt_ptr, seq_lens_ptr, k_cache_ptr, v_cache_ptr, stride_bt, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Asks L2 for the keys and values this program's phase-2 items read (the split of `_attention_item`), a
    128-byte line a request: the cache's old keys do not depend on this step, so they can stream before the
    barrier that the items' queries wait for. The new key's slot is asked for too: its old contents, which the
    item's store then replaces in L2."""
    ITEM: tl.constexpr = k_cache_ptr.dtype.element_ty.primitive_bitwidth // 8
    PER_LINE: tl.constexpr = LINE_BYTES // ITEM
    ROW_LINES: tl.constexpr = (HEAD_DIM * ITEM + LINE_BYTES - 1) // LINE_BYTES
    pid, programs = tl.program_id(0), tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    line = tl.minimum(tl.arange(0, ROW_LINES) * PER_LINE, HEAD_DIM - 1)  # each line's first element in a row
    for item in range(pid, rows * NUM_KV_HEADS * num_splits, programs):
        row, kv_head, _, _, _, start, end = _item_keys(item, num_splits, seq_lens_ptr, NUM_KV_HEADS, BLOCK_N)
        table = bt_ptr + row.to(tl.int64) * stride_bt
        for n0 in range(start, end, BLOCK_N):
            pos = tl.minimum(n0 + offs_n, end - 1)  # past the end: the last key again (inside the table)
            block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
            slot = (pos % BLOCK_SIZE).to(tl.int64)
            k_row = k_cache_ptr + block * stride_kb + slot * stride_kt + kv_head * stride_kh
            v_row = v_cache_ptr + block * stride_vb + slot * stride_vt + kv_head * stride_vh
            prefetch_l2(k_row[:, None] + line[None, :])
            prefetch_l2(v_row[:, None] + line[None, :])
