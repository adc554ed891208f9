"""A whole Llama/Qwen3 decoder layer for a few decode rows in one persistent launch (`decode_layer.py` launches
it; `decode_layer_ref.py` is its specification). One program per SM walks five phases, each a loop over its
share of the phase's work, separated by grid-wide barriers instead of kernel boundaries:

1. h0 = x + residual, RMSNorm, the qkv projection           (tiles of qkv's output columns)
2. q/k RMSNorm, rotary, the new key and value stored by the
   split holding the last key, paged attention; the last
   split to finish merges                                    (row, KV head, split)
3. o_proj, h1 = o + h0 (the returned residual)              (tiles of hidden columns)
4. RMSNorm(h1), gate/up, silu(gate) * up                    (tiles of intermediate columns, gate and up paired)
5. down_proj (the returned output)                          (tiles of hidden columns)

Every intermediate is rounded to the activations' dtype where the model's separate kernels round it, so the
layer computes what they compute (sums in float32, in another order). Device code only; knows the weights'
[out, in] layout and the KV cache's [num_blocks, block_size, Hkv, D], nothing of models or the engine.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_layer_gemv import EPI_RESIDUAL, EPI_SILU_MUL, EPI_STORE, _gemv_phase, _inv_rms, _load_step
from .decode_layer_work import _item_keys, _prefetch_attention_kv, _prefetch_l2, _prefetch_later_tiles, _prefetch_tiles
from .grid_barrier import STAMPS_C, barrier_round, stamp, timed_barrier
from .paged_attention_fold import _fold_is_last, _fold_merge
from .paged_attention_kernels import _attend_paged

ALL_PHASES = tl.constexpr(0)  # PHASE: every phase, barriers between them (the GPU's launch)
# PHASE 1..5: that phase alone, no barrier: the interpreter runs programs one after another, so a barrier
# that waits for the others would never return there; its tests launch the phases one by one instead.
LAST_PHASE = 5
# PREFETCH: how a launch asks L2 for its weights ahead of their phase, the index of its name in
# decode_layer_plan.PREFETCH_MODES (CUDA only: PTX). 1, lines: the whole layer at the start, a 128-byte line a
# request; 2, bulk: each program its own tiles of every projection at the start, PIECES copy-engine requests a
# tile (sm_90); 3, ahead: bulk's qkv tiles at the start, the rest (and the attention items' old keys and values,
# line by line) once the program's qkv tiles are done, so they stream during the other programs' phase 1 and
# attention, not against phase 1's reads; NEXT adds the next layer's qkv tiles during the MLP.
# PRELOAD: each projection's first weight step loaded into registers before the barrier ahead of its phase,
# every later step while the one before computes (decode_layer_gemv.py).


@triton.jit
def _preload(w_ptr, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PAIR: tl.constexpr,
             ON: tl.constexpr):  # fmt: skip
    """ON: this program's first step of W (`_load_step`), asked for now; else placeholders (never read)."""
    if ON:
        w, w2 = _load_step(w_ptr, 0, N, K, BN, BK, PAIR)
    else:  # one return: Triton types every return statement, even in a branch the constexpr prunes
        w, w2 = w_ptr, w_ptr
    return w, w2


@triton.jit
def _head_rope(
    src, heads, h_mask, w_ptr, cos_row, sin_row, eps,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """[BH, BLOCK_D] in the activations' dtype: heads `heads` (masked by h_mask) of a packed qkv row at `src`,
    each RMSNormed over D with `w_ptr` (HAS_NORM) and rotated rotate-half style, rounded as qk_norm_rope_kv.py
    rounds (normed rounded, times the weight rounded; each rotary product rounded, then their sum). Whole-head
    layout: column d pairs with its partner d +- D/2, loaded beside it, so the result feeds attention as is."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    mask = h_mask[:, None] & d_mask[None, :]
    base = src + heads[:, None] * HEAD_DIM
    xa = tl.load(base + d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    xb = tl.load(base + partner[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    dtype = xa.dtype
    if HAS_NORM:
        fa, fb = xa.to(tl.float32), xb.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(fa * fa, axis=1) / HEAD_DIM + eps)[:, None]
        wa = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        wb = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        xa = (wa * (fa * rstd).to(dtype).to(tl.float32)).to(dtype)
        xb = (wb * (fb * rstd).to(dtype).to(tl.float32)).to(dtype)
    col = tl.where(first, d, d - HALF)  # the tables' column: [max_positions, D / 2]
    cos = tl.load(cos_row + col, mask=d_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_row + col, mask=d_mask, other=0.0).to(dtype).to(tl.float32)[None, :]
    a = (xa.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (xb.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return tl.where(first[None, :], a - b, a + b).to(dtype)  # x1 c - x2 s | x2 c + x1 s


@triton.jit
def _attention_item(
    item, num_splits, qkv_ptr, attn_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, k_cache_ptr, v_cache_ptr,
    slot_ptr, bt_ptr, seq_lens_ptr, acc_ptr, m_ptr, l_ptr, tickets_ptr, eps, qk_scale, stride_cos, stride_sin,
    stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_QK_NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Phase 2 for one (row, KV head, split): its query heads normed and rotated from the packed qkv (each split
    redoes it: a few hundred values), then the decode split kernel's arithmetic with its folded reduce
    (paged_attention_kernels.py, paged_attention_fold.py); partials [R, H, S(, D)], a ticket per (row, KV head).
    The split holding the row's last key is the one that stores the new key and value (slot -1: none), before
    its own threads read them back (a CTA barrier between): no other split reads that key, so no other program
    waits for it. A padding row (seq_len 0) has no split: its split 0 zeroes its heads' output."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    QKV: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    row, kv_head, split, seq_len, tokens_per_split, start, end = _item_keys(
        item, num_splits, seq_lens_ptr, NUM_KV_HEADS, BLOCK_N
    )
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    qd = (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + offs_d[None, :]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if start < end:  # splits past the sequence's end hold no keys: they take no part
        live = tl.cdiv(seq_len, tokens_per_split)
        src = qkv_ptr + row.to(tl.int64) * QKV
        pos = tl.load(pos_ptr + row)
        cos_row, sin_row = cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin
        q = _head_rope(src, heads, g_mask, q_w_ptr, cos_row, sin_row, eps, HEAD_DIM, BLOCK_D, HAS_QK_NORM)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if split == live - 1 and slot >= 0:  # the new key and value, where this row has a slot
            first = offs_g < 1
            k = _head_rope(src, NUM_HEADS + kv_head + offs_g * 0, first, k_w_ptr, cos_row, sin_row, eps, HEAD_DIM,
                           BLOCK_D, HAS_QK_NORM)  # fmt: skip  # row 0 only
            block, block_row = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            k_dst = k_cache_ptr + block * stride_kb + block_row * stride_kt + kv_head * stride_kh
            tl.store(k_dst + offs_g[:, None] * 0 + offs_d[None, :], k, mask=first[:, None] & d_mask[None, :])
            v_src = src + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d
            v = tl.load(v_src, mask=d_mask, other=0.0, cache_modifier=".cg")
            v_dst = v_cache_ptr + block * stride_vb + block_row * stride_vt + kv_head * stride_vh + offs_d
            tl.store(v_dst, v, mask=d_mask)
        tl.debug_barrier()  # the new key and value stored before any thread of this program reads them
        m_i, l_i, acc = _attend_paged(
            q, qk_scale, bt_ptr + row.to(tl.int64) * stride_bt, start, end, kv_head, k_cache_ptr, v_cache_ptr,
            k_cache_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, DOT_PRECISION, False,
        )  # fmt: skip
        dst = attn_ptr + qd
        if live == 1:
            tl.store(dst, (acc / l_i[:, None]).to(attn_ptr.dtype.element_ty), mask=out_mask)
        else:
            part0 = (row * NUM_HEADS + heads) * num_splits
            part = part0 + split
            tl.store(m_ptr + part, m_i, mask=g_mask)
            tl.store(l_ptr + part, l_i, mask=g_mask)
            tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
            ticket = tickets_ptr + row * NUM_KV_HEADS + kv_head
            if _fold_is_last(ticket, live):
                _fold_merge(
                    dst, ticket, acc_ptr, m_ptr, l_ptr, part0, live, offs_d, g_mask, d_mask,
                    HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_S,
                )  # fmt: skip
    elif seq_len <= 0 and split == 0:  # a padding row: its output zeroed, as no split writes it
        tl.store(attn_ptr + qd, tl.zeros((BLOCK_G, BLOCK_D), dtype=attn_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["rows", "num_splits", "eps", "qk_scale"])
def _decode_layer_kernel(
    x_ptr, res_ptr, in_norm_ptr, qkv_w_ptr, q_norm_ptr, k_norm_ptr, o_w_ptr, post_norm_ptr, gate_up_w_ptr,
    down_w_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, bt_ptr, seq_lens_ptr,
    qkv_ptr, attn_ptr, act_ptr, acc_ptr, m_ptr, l_ptr, tickets_ptr, bar_ptr,  # scratch
    out_ptr, h1_ptr,  # the layer's results: the MLP's output and the residual stream before it
    next_qkv_w_ptr,  # NEXT: the next layer's qkv weight (unread otherwise)
    clock_ptr,  # TIMING: int64 [programs, STAMPS] (unread otherwise)
    rows, num_splits, eps, qk_scale, stride_cos, stride_sin, stride_bt,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_QK_NORM: tl.constexpr,
    BLOCK_R: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
    BK_QKV: tl.constexpr, BK_O: tl.constexpr, BK_GU: tl.constexpr, BK_DOWN: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, RMS_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr, THREADS: tl.constexpr,
    PIECES: tl.constexpr, NEXT: tl.constexpr, PRELOAD: tl.constexpr, PHASE: tl.constexpr, TIMING: tl.constexpr,
):  # fmt: skip
    stamp(clock_ptr, 0, TIMING)
    QKV: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    BARRIERS: tl.constexpr = PHASE == ALL_PHASES
    pid, programs = tl.program_id(0), tl.num_programs(0)
    offs_r = tl.arange(0, BLOCK_R)
    round0 = barrier_round(bar_ptr, BARRIERS)
    if PREFETCH == 1:  # LINES: the whole layer's weights, in the order the phases read them
        ITEM: tl.constexpr = qkv_w_ptr.dtype.element_ty.primitive_bitwidth // 8
        _prefetch_l2(qkv_w_ptr, QKV * HIDDEN, 256, ITEM)
        _prefetch_l2(o_w_ptr, HIDDEN * Q_SIZE, 256, ITEM)
        _prefetch_l2(gate_up_w_ptr, 2 * INTER * HIDDEN, 256, ITEM)
        _prefetch_l2(down_w_ptr, HIDDEN * INTER, 256, ITEM)
    if PREFETCH >= 2:  # BULK, AHEAD: this program's qkv tiles
        _prefetch_tiles(qkv_w_ptr, QKV, HIDDEN, BN_QKV, False, THREADS, PIECES)
    if PREFETCH == 2:
        _prefetch_later_tiles(
            o_w_ptr, gate_up_w_ptr, down_w_ptr, HIDDEN, INTER, Q_SIZE, BN_O, BN_GU, BN_DOWN, THREADS, PIECES
        )
    if PHASE == ALL_PHASES or PHASE == 1:
        w0, w20 = _preload(qkv_w_ptr, QKV, HIDDEN, BN_QKV, BK_QKV, False, PRELOAD)
        rms = _inv_rms(x_ptr, res_ptr, rows, offs_r, HIDDEN, eps, HAS_RESIDUAL, BLOCK_R, RMS_CHUNK)
        _gemv_phase(
            qkv_w_ptr, w0, w20, x_ptr, res_ptr, in_norm_ptr, rms, qkv_ptr, x_ptr, res_ptr, rows, offs_r,
            QKV, HIDDEN, HAS_RESIDUAL, True, EPI_STORE, HAS_RESIDUAL, BLOCK_R, BN_QKV, BK_QKV, DOT_PRECISION, STAGES,
            PRELOAD,
        )  # fmt: skip
    if PREFETCH == 3:  # AHEAD: the rest once this program's phase-1 reads are done, and its attention's keys
        _prefetch_later_tiles(
            o_w_ptr, gate_up_w_ptr, down_w_ptr, HIDDEN, INTER, Q_SIZE, BN_O, BN_GU, BN_DOWN, THREADS, PIECES
        )
        _prefetch_attention_kv(
            num_splits, rows, bt_ptr, seq_lens_ptr, k_cache_ptr, v_cache_ptr, stride_bt, stride_kb, stride_kt,
            stride_kh, stride_vb, stride_vt, stride_vh, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
    timed_barrier(bar_ptr, clock_ptr, 1, round0, BARRIERS, TIMING)
    if PHASE == ALL_PHASES or PHASE == 2:
        for item in range(pid, rows * NUM_KV_HEADS * num_splits, programs):
            _attention_item(
                item, num_splits, qkv_ptr, attn_ptr, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr,
                v_cache_ptr, slot_ptr, bt_ptr, seq_lens_ptr, acc_ptr, m_ptr, l_ptr, tickets_ptr, eps, qk_scale,
                stride_cos, stride_sin, stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, BLOCK_S, HAS_QK_NORM,
                DOT_PRECISION,
            )  # fmt: skip
    if PHASE == ALL_PHASES or PHASE == 3:
        w0, w20 = _preload(o_w_ptr, HIDDEN, Q_SIZE, BN_O, BK_O, False, PRELOAD)  # streams during barrier 2
    timed_barrier(bar_ptr, clock_ptr, 2, round0, BARRIERS, TIMING)
    if PHASE == ALL_PHASES or PHASE == 3:
        _gemv_phase(
            o_w_ptr, w0, w20, attn_ptr, attn_ptr, o_w_ptr, offs_r, h1_ptr, x_ptr, res_ptr, rows, offs_r,
            HIDDEN, Q_SIZE, False, False, EPI_RESIDUAL, HAS_RESIDUAL, BLOCK_R, BN_O, BK_O, DOT_PRECISION, STAGES,
            PRELOAD,
        )  # fmt: skip
    if NEXT:  # the next layer's phase-1 tiles, streaming during this one's MLP (it reads from L2 by then)
        _prefetch_tiles(next_qkv_w_ptr, QKV, HIDDEN, BN_QKV, False, THREADS, PIECES)
    if PHASE == ALL_PHASES or PHASE == 4:
        w0, w20 = _preload(gate_up_w_ptr, INTER, HIDDEN, BN_GU, BK_GU, True, PRELOAD)
    timed_barrier(bar_ptr, clock_ptr, 3, round0, BARRIERS, TIMING)
    if PHASE == ALL_PHASES or PHASE == 4:
        rms = _inv_rms(h1_ptr, h1_ptr, rows, offs_r, HIDDEN, eps, False, BLOCK_R, RMS_CHUNK)
        _gemv_phase(
            gate_up_w_ptr, w0, w20, h1_ptr, h1_ptr, post_norm_ptr, rms, act_ptr, x_ptr, res_ptr, rows, offs_r,
            INTER, HIDDEN, False, True, EPI_SILU_MUL, HAS_RESIDUAL, BLOCK_R, BN_GU, BK_GU, DOT_PRECISION, STAGES,
            PRELOAD,
        )  # fmt: skip
    if PHASE == ALL_PHASES or PHASE == 5:
        w0, w20 = _preload(down_w_ptr, HIDDEN, INTER, BN_DOWN, BK_DOWN, False, PRELOAD)
    timed_barrier(bar_ptr, clock_ptr, 4, round0, BARRIERS, TIMING)
    if PHASE == ALL_PHASES or PHASE == 5:
        _gemv_phase(
            down_w_ptr, w0, w20, act_ptr, act_ptr, down_w_ptr, offs_r, out_ptr, x_ptr, res_ptr, rows, offs_r,
            HIDDEN, INTER, False, False, EPI_STORE, HAS_RESIDUAL, BLOCK_R, BN_DOWN, BK_DOWN, DOT_PRECISION, STAGES,
            PRELOAD,
        )  # fmt: skip
    stamp(clock_ptr, STAMPS_C - 1, TIMING)
