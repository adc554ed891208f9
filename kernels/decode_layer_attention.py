"""The persistent decode layer's attention phase (decode_layer_kernels.py, phase 2): a program's (row, KV head,
split) items, each its query heads normed and rotated from the packed qkv, the new key and value stored by the
split that holds the row's last key, then the decode split kernel's arithmetic with its folded reduce. With
the launch's PRELOAD, each item's first key tile is read ahead (`_first_kv_tile`): a program's first item's
during barrier 1's wait, each later one's during the item before. The cache's old keys do not depend on the
step, so their round trips leave the phase's dependent chain; the one key a launch writes into a tile read
ahead is the new key of that tile's own item (only the last split of a row and KV head holds it), put in from
registers.
Device code only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_layer_work import _item_keys
from .paged_attention_fold import _fold_is_last, _fold_merge
from .paged_attention_kernels import _attend_paged, _load_kv_tile, _softmax_step


@triton.jit
def _first_kv_tile(
    item, rows, num_splits, seq_lens_ptr, bt_ptr, k_cache_ptr, v_cache_ptr, stride_bt,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, ON: tl.constexpr,
):  # fmt: skip
    """ON: (k, v) [BLOCK_N, BLOCK_D], the first key tile of phase-2 item `item` as the cache holds it now (zeros
    past its keys, or all zeros where there is no such item); else placeholders, never read."""
    if ON:
        items = rows * NUM_KV_HEADS * num_splits
        row, kv_head, _, _, _, start, end = _item_keys(
            tl.minimum(item, items - 1), num_splits, seq_lens_ptr, NUM_KV_HEADS, BLOCK_N
        )
        end = tl.where(item < items, end, start)
        k, v, _ = _load_kv_tile(
            bt_ptr + row.to(tl.int64) * stride_bt, start, end, kv_head, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N,
        )  # fmt: skip
    else:  # one return: Triton types every return statement, even in a branch the constexpr prunes
        k, v = k_cache_ptr, v_cache_ptr
    return k, v


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
    item, k_pre, v_pre, num_splits, qkv_ptr, attn_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, k_cache_ptr,
    v_cache_ptr, slot_ptr, bt_ptr, seq_lens_ptr, acc_ptr, m_ptr, l_ptr, tickets_ptr, eps, qk_scale, stride_cos,
    stride_sin, stride_bt, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_QK_NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, PRE: tl.constexpr,
):  # fmt: skip
    """Phase 2 for one (row, KV head, split): its query heads normed and rotated from the packed qkv (each split
    redoes it: a few hundred values), then the decode split kernel's arithmetic with its folded reduce
    (paged_attention_kernels.py, paged_attention_fold.py); partials [R, H, S(, D)], a ticket per (row, KV head).
    The split holding the row's last key is the one that stores the new key and value (slot -1: none), before
    its own threads read them back (a CTA barrier between): no other split reads that key, so no other program
    waits for it. A padding row (seq_len 0) has no split: its split 0 zeroes its heads' output.
    PRE: the split's first BLOCK_N keys and values are k_pre and v_pre (`_first_kv_tile`, loaded before barrier
    1), the new key and value put in from registers where they fall in that tile; the rest read as without."""
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
        store_new = (split == live - 1) & (slot >= 0)  # the new key and value, where this row has a slot
        keys = start + tl.arange(0, BLOCK_N)
        k_tile, v_tile = k_pre, v_pre  # PRE: the first key tile as the cache held it (else placeholders)
        if store_new:
            first = offs_g < 1
            k = _head_rope(src, NUM_HEADS + kv_head + offs_g * 0, first, k_w_ptr, cos_row, sin_row, eps, HEAD_DIM,
                           BLOCK_D, HAS_QK_NORM)  # fmt: skip  # row 0 only
            v = tl.load(src + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d, mask=d_mask, other=0.0,
                        cache_modifier=".cg")  # fmt: skip
            block, block_row = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            k_dst = k_cache_ptr + block * stride_kb + block_row * stride_kt + kv_head * stride_kh
            tl.store(k_dst + offs_g[:, None] * 0 + offs_d[None, :], k, mask=first[:, None] & d_mask[None, :])
            v_dst = v_cache_ptr + block * stride_vb + block_row * stride_vt + kv_head * stride_vh + offs_d
            tl.store(v_dst, v, mask=d_mask)
            if PRE:  # the tile was read before this store: the new key and value put in from registers
                new = (keys == seq_len - 1)[:, None]
                k_row = tl.sum(tl.where(first[:, None], k.to(tl.float32), 0.0), axis=0).to(k_pre.dtype)  # exact
                k_tile = tl.where(new, k_row[None, :], k_tile)
                v_tile = tl.where(new, v[None, :], v_tile)
        tl.debug_barrier()  # the new key and value stored before any thread of this program reads them
        table = bt_ptr + row.to(tl.int64) * stride_bt
        if PRE:
            m_i, l_i, acc = _softmax_step(
                q, k_tile, v_tile, keys < end, qk_scale, tl.full([BLOCK_G], float("-inf"), tl.float32),
                tl.zeros([BLOCK_G], tl.float32), tl.zeros([BLOCK_G, BLOCK_D], tl.float32), DOT_PRECISION,
            )  # fmt: skip
            m2, l2, acc2 = _attend_paged(
                q, qk_scale, table, start + BLOCK_N, end, kv_head, k_cache_ptr, v_cache_ptr,
                k_cache_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, DOT_PRECISION, False,
            )  # fmt: skip
            # The two states merged; with no further keys (m2 = -inf) the first's bits stand as they are.
            m = tl.maximum(m_i, m2)
            a1, a2 = tl.exp2(m_i - m), tl.exp2(m2 - m)
            m_i, l_i, acc = m, l_i * a1 + l2 * a2, acc * a1[:, None] + acc2 * a2[:, None]
        else:
            m_i, l_i, acc = _attend_paged(
                q, qk_scale, table, start, end, kv_head, k_cache_ptr, v_cache_ptr,
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
