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

from .decode_layer_work import _item_keys, _prefetch_attention_kv, _prefetch_l2, _prefetch_later_tiles, _prefetch_tiles
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


@triton.jit
def _grid_barrier(bar_ptr, PHASE: tl.constexpr):
    """Waits until every program of the launch arrives. bar_ptr: int32 [2], the arrivals of the current round
    and the round's number; the last to arrive puts the count back to 0 before it advances the round, so the
    pair needs no reset between barriers, layers or graph replays.

    Why the data is visible after it: each program's threads finish their stores before its one arrival (the
    CTA barrier, then a release at GPU scope, cumulative over them); the waiting thread's acquire of the new
    round orders its reads after every arrival, and the CTA barrier after it orders its siblings' reads after
    that. The phases read each other's scratch with .cg loads (L2); a new key is stored and read back within
    one program (a CTA barrier between). All programs are resident at once (the launcher starts at most one
    per SM), so the wait cannot starve."""
    if PHASE == ALL_PHASES:
        tl.debug_barrier()
        round_ = tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")  # read before this arrival
        if tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
        else:
            # Spin on plain loads from L2 (an atomic each time would queue behind the arrivals at the same
            # address), then one acquire, which reads the new round and orders what follows after it.
            while tl.load(bar_ptr + 1, volatile=True) == round_:
                pass
            tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


STAMPS = 10  # TIMING: a program's clock readings: start, each barrier's arrival and return (4 x 2), end


@triton.jit
def _stamp(clock_ptr, slot, TIMING: tl.constexpr):
    """TIMING: this program's reading of the GPU's nanosecond clock into its row of clock_ptr [programs, STAMPS]."""
    if TIMING:
        tl.store(clock_ptr + tl.program_id(0) * 10 + slot, tl.extra.cuda.globaltimer())


@triton.jit
def _timed_barrier(bar_ptr, clock_ptr, k, PHASE: tl.constexpr, TIMING: tl.constexpr):
    """Barrier k (1-4), its arrival (once every thread of the program is done) and return stamped when TIMING."""
    if TIMING:
        tl.debug_barrier()
    _stamp(clock_ptr, 2 * k - 1, TIMING)
    _grid_barrier(bar_ptr, PHASE)
    _stamp(clock_ptr, 2 * k, TIMING)


@triton.jit
def _inv_rms(x_ptr, res_ptr, rows, offs_r, K, eps, ADD: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    """[BLOCK_R] 1 / sqrt(mean(h^2) + eps) of each row's h = x (+ residual, rounded to x's dtype), rows of K."""
    acc = tl.zeros((BLOCK_R, CHUNK), dtype=tl.float32)
    r_mask = (offs_r < rows)[:, None]
    for start in range(0, K, CHUNK):
        at = offs_r[:, None] * K + start + tl.arange(0, CHUNK)[None, :]
        h = tl.load(x_ptr + at, mask=r_mask, other=0.0, cache_modifier=".cg")
        if ADD:
            res = tl.load(res_ptr + at, mask=r_mask, other=0.0, cache_modifier=".cg")
            h = (h.to(tl.float32) + res.to(tl.float32)).to(h.dtype)
        hf = h.to(tl.float32)
        acc += hf * hf
    return tl.math.rsqrt(tl.sum(acc, axis=1) / K + eps)


@triton.jit
def _acts(x_ptr, res_ptr, nw_ptr, rows, offs_r, offs_k, K, rms, ADD: tl.constexpr, NORM: tl.constexpr):
    """[BLOCK_R, BK] activations in x's dtype: x (+ residual) at columns offs_k, RMSNormed with `rms` as
    rms_norm_ref rounds (normed rounded, times the weight rounded) when NORM."""
    at = offs_r[:, None] * K + offs_k[None, :]
    r_mask = (offs_r < rows)[:, None]
    x = tl.load(x_ptr + at, mask=r_mask, other=0.0, cache_modifier=".cg")
    dtype = x.dtype
    if ADD:
        res = tl.load(res_ptr + at, mask=r_mask, other=0.0, cache_modifier=".cg")
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
    if NORM:
        w = tl.load(nw_ptr + offs_k)[None, :].to(tl.float32)
        x = (w * (x.to(tl.float32) * rms[:, None]).to(dtype).to(tl.float32)).to(dtype)
    return x


@triton.jit
def _dot_rows(acc, w, a, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_R, BN] + a [BLOCK_R, BK] x w [BN, BK]^T: one row on the CUDA cores, more through one
    tensor-core dot that shares the weight tile between them."""
    if BLOCK_R == 1:
        return acc + tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
    return acc + tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)


@triton.jit
def _gemv_tile(
    w_ptr, n0, n1, K, x_ptr, res_ptr, nw_ptr, rows, offs_r, rms,
    ADD: tl.constexpr, NORM: tl.constexpr, BLOCK_R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, PAIR: tl.constexpr,
):  # fmt: skip
    """[BLOCK_R, BN] float32 twice: rows x W[n0 : n0 + BN]^T over K (a multiple of BK), W [N, K] row-major, and
    with PAIR the same for W[n1 : n1 + BN] (gate and up: both tiles' loads in flight together; else the
    second is the first). A K step of BK columns keeps many bytes in flight per program (the launcher sizes
    it); STAGES > 1 pipelines the steps."""
    w_rows = w_ptr + (n0 + tl.arange(0, BN)).to(tl.int64)[:, None] * K
    w_rows2 = w_ptr + (n1 + tl.arange(0, BN)).to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_R, BN), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BK)
        w = tl.load(w_rows + offs_k[None, :])  # [BN, BK]
        if PAIR:
            w2 = tl.load(w_rows2 + offs_k[None, :])
        a = _acts(x_ptr, res_ptr, nw_ptr, rows, offs_r, offs_k, K, rms, ADD, NORM)  # [BLOCK_R, BK]
        acc = _dot_rows(acc, w, a, BLOCK_R, DOT_PRECISION)
        if PAIR:
            acc2 = _dot_rows(acc2, w2, a, BLOCK_R, DOT_PRECISION)
    if PAIR:
        return acc, acc2
    return acc, acc


@triton.jit
def _project(
    w_ptr, N, K, x_ptr, res_ptr, nw_ptr, out_ptr, rows, offs_r, rms,
    ADD: tl.constexpr, NORM: tl.constexpr, BLOCK_R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """out [rows, N] = the rows' activations x W^T, this program's share of N's tiles (every program-th)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    for tile in range(pid, N // BN, programs):
        acc, _ = _gemv_tile(
            w_ptr, tile * BN, 0, K, x_ptr, res_ptr, nw_ptr, rows, offs_r, rms,
            ADD, NORM, BLOCK_R, BN, BK, DOT_PRECISION, STAGES, False,
        )  # fmt: skip
        _store_rows(out_ptr, N, offs_r, rows, tile * BN + tl.arange(0, BN), acc)


@triton.jit
def _store_rows(ptr, N, offs_r, rows, offs_n, value):
    tl.store(ptr + offs_r[:, None] * N + offs_n[None, :], value.to(ptr.dtype.element_ty), mask=(offs_r < rows)[:, None])


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
    PIECES: tl.constexpr, NEXT: tl.constexpr, PHASE: tl.constexpr, TIMING: tl.constexpr,
):  # fmt: skip
    _stamp(clock_ptr, 0, TIMING)
    QKV: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    pid, programs = tl.program_id(0), tl.num_programs(0)
    offs_r = tl.arange(0, BLOCK_R)
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
        rms = _inv_rms(x_ptr, res_ptr, rows, offs_r, HIDDEN, eps, HAS_RESIDUAL, BLOCK_R, RMS_CHUNK)
        _project(
            qkv_w_ptr, QKV, HIDDEN, x_ptr, res_ptr, in_norm_ptr, qkv_ptr, rows, offs_r, rms,
            HAS_RESIDUAL, True, BLOCK_R, BN_QKV, BK_QKV, DOT_PRECISION, STAGES,
        )  # fmt: skip
    if PREFETCH == 3:  # AHEAD: the rest once this program's phase-1 reads are done, and its attention's keys
        _prefetch_later_tiles(
            o_w_ptr, gate_up_w_ptr, down_w_ptr, HIDDEN, INTER, Q_SIZE, BN_O, BN_GU, BN_DOWN, THREADS, PIECES
        )
        _prefetch_attention_kv(
            num_splits, rows, bt_ptr, seq_lens_ptr, k_cache_ptr, v_cache_ptr, stride_bt, stride_kb, stride_kt,
            stride_kh, stride_vb, stride_vt, stride_vh, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
        )  # fmt: skip
    _timed_barrier(bar_ptr, clock_ptr, 1, PHASE, TIMING)
    if PHASE == ALL_PHASES or PHASE == 2:
        for item in range(pid, rows * NUM_KV_HEADS * num_splits, programs):
            _attention_item(
                item, num_splits, qkv_ptr, attn_ptr, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr,
                v_cache_ptr, slot_ptr, bt_ptr, seq_lens_ptr, acc_ptr, m_ptr, l_ptr, tickets_ptr, eps, qk_scale,
                stride_cos, stride_sin, stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, BLOCK_S, HAS_QK_NORM,
                DOT_PRECISION,
            )  # fmt: skip
    _timed_barrier(bar_ptr, clock_ptr, 2, PHASE, TIMING)
    if PHASE == ALL_PHASES or PHASE == 3:
        for tile in range(pid, HIDDEN // BN_O, programs):
            offs_n = tile * BN_O + tl.arange(0, BN_O)
            o, _ = _gemv_tile(
                o_w_ptr, tile * BN_O, 0, Q_SIZE, attn_ptr, attn_ptr, o_w_ptr, rows, offs_r, offs_r,
                False, False, BLOCK_R, BN_O, BK_O, DOT_PRECISION, STAGES, False,
            )  # fmt: skip
            h0 = _acts(x_ptr, res_ptr, x_ptr, rows, offs_r, offs_n, HIDDEN, offs_r, HAS_RESIDUAL, False)
            h1 = (o.to(h0.dtype).to(tl.float32) + h0.to(tl.float32)).to(h0.dtype)  # torch's `o + h0`
            _store_rows(h1_ptr, HIDDEN, offs_r, rows, offs_n, h1)
    if NEXT:  # the next layer's phase-1 tiles, streaming during this one's MLP (it reads from L2 by then)
        _prefetch_tiles(next_qkv_w_ptr, QKV, HIDDEN, BN_QKV, False, THREADS, PIECES)
    _timed_barrier(bar_ptr, clock_ptr, 3, PHASE, TIMING)
    if PHASE == ALL_PHASES or PHASE == 4:
        rms = _inv_rms(h1_ptr, h1_ptr, rows, offs_r, HIDDEN, eps, False, BLOCK_R, RMS_CHUNK)
        for tile in range(pid, INTER // BN_GU, programs):
            gate, up = _gemv_tile(
                gate_up_w_ptr, tile * BN_GU, INTER + tile * BN_GU, HIDDEN, h1_ptr, h1_ptr, post_norm_ptr, rows,
                offs_r, rms, False, True, BLOCK_R, BN_GU, BK_GU, DOT_PRECISION, STAGES, True,
            )  # fmt: skip
            dtype = act_ptr.dtype.element_ty
            g = gate.to(dtype).to(tl.float32)  # silu_mul.py's roundings: silu in float32 rounded, the product rounded
            act = (tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
            _store_rows(act_ptr, INTER, offs_r, rows, tile * BN_GU + tl.arange(0, BN_GU), act)
    _timed_barrier(bar_ptr, clock_ptr, 4, PHASE, TIMING)
    if PHASE == ALL_PHASES or PHASE == 5:
        _project(
            down_w_ptr, HIDDEN, INTER, act_ptr, act_ptr, down_w_ptr, out_ptr, rows, offs_r, offs_r,
            False, False, BLOCK_R, BN_DOWN, BK_DOWN, DOT_PRECISION, STAGES,
        )  # fmt: skip
    _stamp(clock_ptr, 9, TIMING)
