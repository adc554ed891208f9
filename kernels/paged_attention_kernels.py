"""The paged attention kernels' device code, in Triton: the split-KV decode kernel and its reduction (both
also in cascade form, CASCADE: see paged_attention_cascade.py), and the varlen causal prefill kernel. Launched
(with their input contract and plans) by paged_attention.py, whose docstring describes what they compute;
`paged_attention_ref` is their specification.

An FP8 cache (KV_FP8, a constexpr: caches in the activations' dtype compile the code they always ran) holds
e4m3 codes: each key and value tile is widened to the queries' dtype (exact: every e4m3 value is a bfloat16,
float16 and float32 value), k_scale (read on the device, so a CUDA graph replays with it) multiplies the
scores' factor and v_scale the output, so the inner loops gain only the conversion.

FOLD (outside CASCADE): the split kernel finishes the reduction itself (paged_attention_fold.py), one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .paged_attention_fold import _fold_is_last, _fold_merge


@triton.jit
def _dim_mask(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Masks the padded head dims; a constant-true mask when there are none, so loads stay unmasked/vectorized."""
    if BLOCK_D == HEAD_DIM:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return offs_d < HEAD_DIM


@triton.jit
def _load_kv_tile(
    table, n0, end, kv_head, k_ptr, v_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(k, v, valid): keys and values [BLOCK_N, BLOCK_D] of positions n0 + [0, BLOCK_N) of one block table
    (`table`: its row) and `kv_head`, those at `end` or past it zeros (valid [BLOCK_N] says which)."""
    offs_d = tl.arange(0, BLOCK_D)
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    if BLOCK_D == HEAD_DIM:
        kv_mask = valid[:, None]  # no padded dims: a row-constant mask keeps the loads vectorised
    else:
        kv_mask = valid[:, None] & _dim_mask(offs_d, HEAD_DIM, BLOCK_D)[None, :]
    k_at = k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    v_at = v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
    return tl.load(k_at, mask=kv_mask, other=0.0), tl.load(v_at, mask=kv_mask, other=0.0), valid


@triton.jit
def _softmax_step(q, k, v, valid, qk_scale, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax: (m, l, acc) after q's rows see keys k and values v [N, D] (valid [N]
    of them; a tile holds one valid key at least)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N], log2 domain
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid key
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_paged(
    q, qk_scale, table, start, end, kv_head, k_ptr, v_ptr, v_scale_ptr,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """The online softmax of `q`'s ROWS query rows ([ROWS, BLOCK_D]; scores times `qk_scale`, log2 domain)
    over the keys [start, end) of one block table (`table`: its row), BLOCK_N keys a tile, K and V of
    `kv_head`: (m, l, acc) unnormalised, acc times an FP8 cache's v_scale; (-inf, 0, 0) for no keys. Shared by
    the decode split kernel (a sequence's query heads of one KV head), the cascade's prefix kernel (a unit's
    members' heads) and the persistent decode layer."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        k, v, valid = _load_kv_tile(
            table, n0, end, kv_head, k_ptr, v_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N,
        )  # fmt: skip
        if KV_FP8:
            k, v = k.to(q.dtype), v.to(q.dtype)
        m_i, l_i, acc = _softmax_step(q, k, v, valid, qk_scale, m_i, l_i, acc, DOT_PRECISION)
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    return m_i, l_i, acc


# num_splits is a plain argument, not specialised (1 / multiple of 16 / other would be three compilations), so
# warm-up compiles one variant and a CUDA graph may bake in any split count; the window likewise.
@triton.jit(do_not_specialize=["num_splits", "prefix_splits", "window"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seqs_ptr, out_ptr,
    acc_ptr, m_ptr, l_ptr,  # partials: acc [B, H, S + P, D] fp32, m/l [B, H, S + P] fp32 (unused with one split)
    k_scale_ptr, v_scale_ptr,  # an FP8 cache's float32 scales (unread otherwise)
    skip_ptr,  # CASCADE: [B] int32, the shared-prefix keys each work-list entry leaves to its unit (unread otherwise)
    counter_ptr,  # FOLD: [B, Hkv] int32 tickets, 0 between launches (unread otherwise)
    qk_scale, num_splits, prefix_splits, window,  # prefix_splits (P): the cascade's partial slots; 0 without
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, KV_FP8: tl.constexpr, CASCADE: tl.constexpr, FOLD: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # a programmatic dependent (kernels/pdl.py): the query and the new key land before any read; the
        tl.extra.cuda.gdc_wait()  # next launch (o_proj's GEMV) may then start and ask L2 for its weights
        tl.extra.cuda.gdc_launch_dependents()
    # KV heads vary fastest: the programs of one sequence run together and read whole cache rows between
    # them ([block, slot, all heads, D] is contiguous), and the sequences go in work-list order (longest first).
    kv_head, pid_b, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(seqs_ptr + pid_b)
    if seq < 0:  # padding of a graph's fixed grid: no sequence
        return
    row = tl.load(qsl_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence splits its own keys (read on the device, so a CUDA graph replays any lengths): all of
    # them, or with a window the last `window` (the query, at seq_len - 1, sees exactly those, so no mask).
    # Splits past the end stay empty (m = -inf, l = 0) and weigh nothing in the reduction.
    # With CASCADE, a sequence's shared prefix is its unit's (paged_attention_cascade.py): only the keys after it.
    if CASCADE:
        lo = tl.load(skip_ptr + pid_b)
    elif SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = seq_len * 0
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if FOLD:
        # Only the splits holding keys take part: the last one to finish merges them (its sequence may be
        # shorter than the grid's splits need). Empty ones leave at once, writing nothing.
        live = tl.cdiv(seq_len - lo, tl.maximum(tokens_per_split, 1))
        if start >= end:
            return
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # the query heads sharing this KV head: K/V are loaded once for all
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G, D]
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    table = bt_ptr + seq.to(tl.int64) * stride_bt
    m_i, l_i, acc = _attend_paged(
        q, qk_scale, table, start, end, kv_head, k_ptr, v_ptr, v_scale_ptr,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, DOT_PRECISION, KV_FP8,
    )  # fmt: skip
    if CASCADE:
        whole = num_splits + lo == 1  # one split and no shared prefix (lo >= 0, num_splits >= 1)
    elif FOLD:
        whole = live == 1
    else:
        whole = num_splits == 1
    dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]  # [G, D]
    if whole:  # the whole sequence in this program: normalise and write the output, no reduce
        out = acc / l_i[:, None]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        return
    parts = num_splits + prefix_splits
    part0 = (pid_b * tl.num_programs(0) * GROUP + heads) * parts  # [G] rows of [B, H, S + P]
    part = part0 + split
    tl.store(m_ptr + part, m_i, mask=g_mask)
    tl.store(l_ptr + part, l_i, mask=g_mask)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
    if FOLD:
        counter = counter_ptr + pid_b * tl.num_programs(0) + kv_head
        if _fold_is_last(counter, live):
            _fold_merge(
                dst, counter, acc_ptr, m_ptr, l_ptr, part0, live, offs_d, g_mask, d_mask,
                HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_S,
            )  # fmt: skip


@triton.jit(do_not_specialize=["num_splits", "prefix_splits"])
def _decode_reduce_kernel(
    out_ptr, acc_ptr, m_ptr, l_ptr, qsl_ptr, seqs_ptr, skip_ptr, num_splits, prefix_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CASCADE: tl.constexpr,
):  # fmt: skip
    pid_b, head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(seqs_ptr + pid_b)
    if seq < 0:
        return
    if CASCADE:  # the prefix's slots hold partials of sequences in a unit only
        skip = tl.load(skip_ptr + pid_b)
        if num_splits + skip == 1:  # the split kernel wrote this one's output
            return
        num_parts = num_splits + tl.where(skip > 0, prefix_splits, 0)
    else:
        num_parts = num_splits
    row = tl.load(qsl_ptr + seq)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_parts
    d_mask = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    part = (pid_b * tl.num_programs(1) + head) * (num_splits + prefix_splits) + offs_s
    m = tl.load(m_ptr + part, mask=s_mask, other=float("-inf"))  # empty splits hold -inf
    l_s = tl.load(l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    weight = tl.exp2(m - tl.max(m, axis=0))  # split 0 always holds keys, so the max is finite
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_tile(
    q, m_i, l_i, acc, pos, offs_m, context, kv_lo, kv_hi, window, table, k_base, v_base, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt, d_mask,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax over the keys at `pos` [N]; MASKED applies causality, the end and, when
    SLIDING, each row's window."""
    if MASKED:
        # Never read past the sequence (unwritten slots may hold NaN), nor before the first row's window
        # (those blocks may belong to another sequence by now).
        if SLIDING:
            in_seq = (pos < kv_hi) & (pos >= kv_lo)
        else:
            in_seq = pos < kv_hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        kv_mask = in_seq[:, None] & d_mask[None, :]
    else:
        block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    slot = (pos % BLOCK_SIZE)[:, None]
    k = tl.load(k_base + block[:, None] * stride_kb + slot * stride_kt, mask=kv_mask, other=0.0)  # [N, D]
    v = tl.load(v_base + block[:, None] * stride_vb + slot * stride_vt, mask=kv_mask, other=0.0)
    if KV_FP8:
        k, v = k.to(q.dtype), v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 domain
    if MASKED:
        q_pos = context + offs_m[:, None]
        visible = (pos[None, :] <= q_pos) & in_seq[None, :]
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if SLIDING:
        # A row may see no key of this tile yet (its window starts further on): shift by 0 instead of
        # -inf, so its alpha and p are 0 rather than NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new  # finite: key 0 is visible to every row, in the first tile
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, tiles_ptr,
    k_scale_ptr, v_scale_ptr,  # an FP8 cache's float32 scales (unread otherwise)
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TILES_HEADER: tl.constexpr, SLIDING: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)  # heads vary fastest: a GQA group shares K/V in L2
    kv_head = head // GROUP
    num_tiles = tl.load(tiles_ptr)  # the live count: a graph's grid may hold more programs than tiles
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    k_base = k_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_ptr + kv_head * stride_vh + offs_d[None, :]
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    # Eager launches give each program one tile; a graph's fixed grid strides over however many there are.
    for tile in range(tl.program_id(1), num_tiles, tl.num_programs(1)):
        seq = tl.load(tiles_ptr + TILES_HEADER + 2 * tile)
        q_start = tl.load(tiles_ptr + TILES_HEADER + 2 * tile + 1)  # first query row of the tile, in the sequence
        row0 = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - row0
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # query j sits at position context + j
        offs_m = q_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        q = tl.load(
            q_ptr + (row0 + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [M, D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = bt_ptr + seq.to(tl.int64) * stride_bt
        # Keys before context + q_start are visible to every row of the tile: no causal mask there.
        full_hi = ((context + q_start) // BLOCK_N) * BLOCK_N
        kv_hi = tl.minimum(seq_len, context + q_start + BLOCK_M)
        if SLIDING:
            # Keys before the first row's window are read by no row; from full_lo on, every real row's window
            # (the last one's starts at kv_hi - window) holds them: masked tiles only between the two.
            kv_lo = tl.maximum(context + q_start - window + 1, 0)
            lo = (kv_lo // BLOCK_N) * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(kv_hi - window, 0), BLOCK_N) * BLOCK_N
            full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
            for n0 in range(lo, full_lo, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(
                    q, m_i, l_i, acc, n0 + offs_n, offs_m, context, kv_lo, kv_hi, window, table, k_base, v_base,
                    qk_scale, stride_kb, stride_kt, stride_vb, stride_vt, d_mask, BLOCK_SIZE, True, DOT_PRECISION,
                    SLIDING, KV_FP8,
                )  # fmt: skip
        else:
            kv_lo = 0
            full_lo = full_hi * 0
        for n0 in range(full_lo, full_hi, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, n0 + offs_n, offs_m, context, kv_lo, kv_hi, window, table, k_base, v_base, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt, d_mask, BLOCK_SIZE, False, DOT_PRECISION, SLIDING, KV_FP8,
            )  # fmt: skip
        for n0 in range(full_hi, kv_hi, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, n0 + offs_n, offs_m, context, kv_lo, kv_hi, window, table, k_base, v_base, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt, d_mask, BLOCK_SIZE, True, DOT_PRECISION, SLIDING, KV_FP8,
            )  # fmt: skip
        if SLIDING:  # padding rows past the sequence may have no key in their window: 0, not 0 / 0
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        if KV_FP8:
            out = out * tl.load(v_scale_ptr)
        tl.store(
            out_ptr + (row0 + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )
