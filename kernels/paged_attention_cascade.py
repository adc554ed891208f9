"""Cascade decode attention's device code: a group's shared prefix read once per step for all its members.

One program per (KV head, unit, prefix split) loads each key/value tile of the unit's shared prefix once and
attends every member's queries to it at once (members x query heads of the KV head as the rows of one tl.dot,
a small non-causal prefill), leaving per row an unnormalised partial (acc, max, sum) in a split slot past
the suffix's: `_decode_split_kernel` (CASCADE) walks each member's keys after the prefix into the first
`num_splits` slots and `_decode_reduce_kernel` merges them all by their log-sum-exp, exactly the softmax over
every key. Units and their members come from kernels/cascade_plan.py; launched by kernels/paged_attention.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .paged_attention_kernels import _attend_paged, _dim_mask


@triton.jit(do_not_specialize=["num_splits", "prefix_splits"])
def _cascade_prefix_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seqs_ptr, units_ptr, members_ptr,
    acc_ptr, m_ptr, l_ptr,  # partials [B, H, num_splits + prefix_splits(, D)] fp32, B in work-list order
    k_scale_ptr, v_scale_ptr,  # an FP8 cache's float32 scales (unread otherwise)
    qk_scale, num_splits, prefix_splits,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    kv_head, unit, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # A unit: [prefix tokens, block-table row, first member, member count]; count 0 is an empty unit (a
    # graph's fixed grid holds room for every unit a batch could form).
    count = tl.load(units_ptr + 4 * unit + 3)
    if count == 0:
        return
    prefix = tl.load(units_ptr + 4 * unit)
    table = bt_ptr + tl.load(units_ptr + 4 * unit + 1).to(tl.int64) * stride_bt
    first = tl.load(units_ptr + 4 * unit + 2)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    member = offs_r // GROUP  # row r: member r // GROUP, query head kv_head * GROUP + r % GROUP
    r_mask = member < count
    d_mask = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    heads = kv_head * GROUP + offs_r % GROUP
    pid = tl.load(members_ptr + first + member, mask=r_mask, other=0)  # the member's work-list position
    seq = tl.load(seqs_ptr + pid, mask=r_mask, other=0)
    row = tl.load(qsl_ptr + seq, mask=r_mask, other=0)
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [M, D]
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    # The prefix splits as the decode kernel splits a sequence; splits past its end stay empty.
    tokens_per_split = tl.cdiv(tl.cdiv(prefix, prefix_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, prefix)
    m_i, l_i, acc = _attend_paged(
        q, qk_scale, table, start, end, kv_head, k_ptr, v_ptr, v_scale_ptr,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        BLOCK_M, HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, DOT_PRECISION, KV_FP8,
    )  # fmt: skip
    parts = num_splits + prefix_splits
    part = (pid * (tl.num_programs(0) * GROUP) + heads) * parts + num_splits + split  # [M] rows of [B, H, parts]
    tl.store(m_ptr + part, m_i, mask=r_mask)
    tl.store(l_ptr + part, l_i, mask=r_mask)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=r_mask[:, None] & d_mask[None, :])
