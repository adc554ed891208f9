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

from .decode_layer_attention import _attention_item, _first_kv_tile
from .decode_layer_gemv import EPI_RESIDUAL, EPI_SILU_MUL, EPI_STORE, _gemv_phase, _inv_rms, _load_step
from .decode_layer_work import _prefetch_attention_kv, _prefetch_l2, _prefetch_later_tiles, _prefetch_tiles
from .grid_barrier import STAMPS_C, barrier_round, stamp, timed_arrive, timed_wait

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
# PRELOAD: each projection's first weight step loaded into registers between the arrival at the barrier ahead
# of its phase and the wait there, every later step while the one before computes (decode_layer_gemv.py); the
# first attention item's first key tile likewise at barrier 1, each later item's during the item before
# (decode_layer_attention.py).


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
def _projection_after_barrier(
    bar_ptr, clock_ptr, k, round0, w_ptr, in_ptr, nw_ptr, out_ptr, x_ptr, res_ptr, rows, offs_r, eps,
    N: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, EPI: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RMS_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STAGES: tl.constexpr, PRELOAD: tl.constexpr, ON: tl.constexpr, BARRIERS: tl.constexpr, PTX: tl.constexpr,
    TIMING: tl.constexpr,
):  # fmt: skip
    """Barrier k, then (ON: this launch runs the phase) out = epilogue(in_ptr's rows, RMSNormed by nw_ptr with
    NORM, x W^T): with PRELOAD its first weight step asked for between the arrival and the wait."""
    timed_arrive(bar_ptr, clock_ptr, k, BARRIERS, TIMING)
    if ON:
        w0, w20 = _preload(w_ptr, N, K, BN, BK, EPI == EPI_SILU_MUL, PRELOAD)  # streams during the wait
    timed_wait(bar_ptr, clock_ptr, k, round0, BARRIERS, PTX, TIMING)
    if ON:
        rms = offs_r  # unread without NORM
        if NORM:
            rms = _inv_rms(in_ptr, in_ptr, rows, offs_r, K, eps, False, BLOCK_R, RMS_CHUNK)
        _gemv_phase(
            w_ptr, w0, w20, in_ptr, in_ptr, nw_ptr, rms, out_ptr, x_ptr, res_ptr, rows, offs_r, N, K, False, NORM, EPI,
            HAS_RESIDUAL, BLOCK_R, BN, BK, DOT_PRECISION, STAGES, PRELOAD,
        )  # fmt: skip


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
    PTX: tl.constexpr,
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
    timed_arrive(bar_ptr, clock_ptr, 1, BARRIERS, TIMING)
    if PHASE == ALL_PHASES or PHASE == 2:  # after the arrival, which would wait for these loads
        k_pre, v_pre = _first_kv_tile(
            pid, rows, num_splits, seq_lens_ptr, bt_ptr, k_cache_ptr, v_cache_ptr, stride_bt, stride_kb, stride_kt,
            stride_kh, stride_vb, stride_vt, stride_vh, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, PRELOAD,
        )  # fmt: skip
    timed_wait(bar_ptr, clock_ptr, 1, round0, BARRIERS, PTX, TIMING)
    if PHASE == ALL_PHASES or PHASE == 2:
        for item in range(pid, rows * NUM_KV_HEADS * num_splits, programs):
            # PRELOAD: the next item's first key tile asked for while this one computes (the first item's came
            # during barrier 1's wait); else placeholders
            k_next, v_next = _first_kv_tile(
                item + programs, rows, num_splits, seq_lens_ptr, bt_ptr, k_cache_ptr, v_cache_ptr, stride_bt,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                BLOCK_D, BLOCK_N, PRELOAD,
            )  # fmt: skip
            _attention_item(
                item, k_pre, v_pre, num_splits, qkv_ptr, attn_ptr, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
                k_cache_ptr, v_cache_ptr, slot_ptr, bt_ptr, seq_lens_ptr, acc_ptr, m_ptr, l_ptr, tickets_ptr, eps,
                qk_scale, stride_cos, stride_sin, stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                stride_vh, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, BLOCK_S,
                HAS_QK_NORM, DOT_PRECISION, PRELOAD,
            )  # fmt: skip
            k_pre, v_pre = k_next, v_next
    _projection_after_barrier(
        bar_ptr, clock_ptr, 2, round0, o_w_ptr, attn_ptr, o_w_ptr, h1_ptr, x_ptr, res_ptr, rows, offs_r, eps,
        HIDDEN, Q_SIZE, False, EPI_RESIDUAL, HAS_RESIDUAL, BLOCK_R, BN_O, BK_O, RMS_CHUNK, DOT_PRECISION, STAGES,
        PRELOAD, PHASE == ALL_PHASES or PHASE == 3, BARRIERS, PTX, TIMING,
    )  # fmt: skip
    if NEXT:  # the next layer's phase-1 tiles, streaming during this one's MLP (it reads from L2 by then)
        _prefetch_tiles(next_qkv_w_ptr, QKV, HIDDEN, BN_QKV, False, THREADS, PIECES)
    _projection_after_barrier(
        bar_ptr, clock_ptr, 3, round0, gate_up_w_ptr, h1_ptr, post_norm_ptr, act_ptr, x_ptr, res_ptr, rows, offs_r,
        eps, INTER, HIDDEN, True, EPI_SILU_MUL, HAS_RESIDUAL, BLOCK_R, BN_GU, BK_GU, RMS_CHUNK, DOT_PRECISION, STAGES,
        PRELOAD, PHASE == ALL_PHASES or PHASE == 4, BARRIERS, PTX, TIMING,
    )  # fmt: skip
    _projection_after_barrier(
        bar_ptr, clock_ptr, 4, round0, down_w_ptr, act_ptr, down_w_ptr, out_ptr, x_ptr, res_ptr, rows, offs_r, eps,
        HIDDEN, INTER, False, EPI_STORE, HAS_RESIDUAL, BLOCK_R, BN_DOWN, BK_DOWN, RMS_CHUNK, DOT_PRECISION, STAGES,
        PRELOAD, PHASE == ALL_PHASES or PHASE == 5, BARRIERS, PTX, TIMING,
    )  # fmt: skip
    stamp(clock_ptr, STAMPS_C - 1, TIMING)
