"""Paged attention in Triton: split-KV decode ("flash-decoding") and a varlen causal prefill forward.
A decode launch of one split (a full batch fills the GPU without splitting) normalises and writes its output
in the split kernel; more splits leave partials that a second launch merges.

Both read keys/values through each sequence's block table, token by token, so any power-of-two block size
works. A sliding-window layer (`window` given) reads only the keys inside its queries' windows: a decode
program walks the last `window` keys, a prefill tile starts at its first row's window (a constexpr switch, so
global layers run the kernels they always ran). `paged_attention_ref` (paged_attention_ref.py) is the
specification, in pure PyTorch. Knows nothing of the engine: the caller hands in packed queries, the cache,
and the per-step plans (paged_attention_plan.py, re-exported here: `plan_prefill_tiles`, `tile_buffer`,
`choose_num_splits`).

Both kernels also run inside CUDA graphs whose launch shapes are fixed for any step of up to N tokens: a
decode entry of -1 is no work (its programs exit at once), and prefill programs walk the tiles with a
stride, up to a live count read on the device (`TILES_HEADER`), so a fixed grid covers any tile count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention_checks import check_inputs, check_window
from .paged_attention_plan import (
    MAX_SPLITS,
    TILES_HEADER,
    choose_num_splits,
    max_prefill_tiles,
    plan_prefill_tiles,
    prefill_block_m,
    tile_buffer,
)
from .paged_attention_ref import paged_attention_ref

__all__ = [
    "TILES_HEADER",
    "choose_num_splits",
    "max_prefill_tiles",
    "paged_attention_ref",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_prefill_tiles",
    "prefill_block_m",
    "runs_in_interpreter",
    "tile_buffer",
]

_LOG2E = 1.4426950408889634


@triton.jit
def _dim_mask(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Masks the padded head dims; a constant-true mask when there are none, so loads stay unmasked/vectorized."""
    if BLOCK_D == HEAD_DIM:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return offs_d < HEAD_DIM


# num_splits is a plain argument, not specialised (1 / multiple of 16 / other would be three compilations), so
# warm-up compiles one variant and a CUDA graph may bake in any split count; the window likewise.
@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seqs_ptr, out_ptr,
    acc_ptr, m_ptr, l_ptr,  # partials: acc [B, H, S, D] fp32, m/l [B, H, S] fp32 (unused with one split)
    qk_scale, num_splits, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
):  # fmt: skip
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
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = seq_len * 0
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # the query heads sharing this KV head: K/V are loaded once for all
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G, D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = bt_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        if BLOCK_D == HEAD_DIM:
            kv_mask = valid[:, None]  # no padded dims: a row-constant mask keeps the loads vectorised
        else:
            kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # [N, D]
        v = tl.load(
            v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N], log2 domain
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if num_splits == 1:  # the whole sequence in this program: normalise and write the output, no reduce
        out = acc / l_i[:, None]
        dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        return
    part = (pid_b * tl.num_programs(0) * GROUP + heads) * num_splits + split  # [G] rows of [B, H, S]
    tl.store(m_ptr + part, m_i, mask=g_mask)
    tl.store(l_ptr + part, l_i, mask=g_mask)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr, acc_ptr, m_ptr, l_ptr, qsl_ptr, seqs_ptr, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_b, head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(seqs_ptr + pid_b)
    if seq < 0:
        return
    row = tl.load(qsl_ptr + seq)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    part = (pid_b * tl.num_programs(1) + head) * num_splits + offs_s
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
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, tiles_ptr, qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TILES_HEADER: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)  # heads vary fastest: a GQA group shares K/V in L2
    kv_head = head // GROUP
    num_tiles = tl.load(tiles_ptr)  # the live count: a graph's grid may hold more programs than tiles
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    k_base = k_ptr + kv_head * stride_kh + offs_d[None, :]
    v_base = v_ptr + kv_head * stride_vh + offs_d[None, :]
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
                    SLIDING,
                )  # fmt: skip
        else:
            kv_lo = 0
            full_lo = full_hi * 0
        for n0 in range(full_lo, full_hi, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, n0 + offs_n, offs_m, context, kv_lo, kv_hi, window, table, k_base, v_base, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt, d_mask, BLOCK_SIZE, False, DOT_PRECISION, SLIDING,
            )  # fmt: skip
        for n0 in range(full_hi, kv_hi, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, n0 + offs_n, offs_m, context, kv_lo, kv_hi, window, table, k_base, v_base, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt, d_mask, BLOCK_SIZE, True, DOT_PRECISION, SLIDING,
            )  # fmt: skip
        if SLIDING:  # padding rows past the sequence may have no key in their window: 0, not 0 / 0
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (row0 + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def runs_in_interpreter() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_prefill_kernel).__name__ == "InterpretedFunction"


# ---------------------------------------------------------------------------------------------- launchers
def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # no TF32 rounding for float32 inputs


def paged_decode_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    decode_seqs: torch.Tensor,  # [Bd] int32: the batch index of each single-query sequence; -1: none (padding).
    # Programs start in this order: longest first keeps the last wave short (the caller's planning).
    out: torch.Tensor,  # [T, H, D]: only the rows of decode_seqs are written
    scale: float,
    num_splits: int,  # KV splits per sequence; each sequence divides its own length (read on the device)
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
    window: int | None = None,  # a sliding window: each query reads its last `window` keys; None: all
) -> None:
    group, head_dim, block_size = check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    check_window(window)
    if num_stages is None:
        # Two stages: half the shared memory of four, so an SM holds more programs, which beats a deeper
        # pipeline once lengths vary (H200, batch 256, lengths U[200, 2048], longest first: 0.372 against
        # 0.387 ms; bench/RESULTS.md run 19).
        num_stages = 2
    if decode_seqs.dtype != torch.int32 or decode_seqs.dim() != 1:
        raise TypeError(f"decode_seqs must be 1-D int32; got {decode_seqs.dtype} {tuple(decode_seqs.shape)}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits} must be in [1, {MAX_SPLITS}]")
    num_decode, num_heads, num_kv_heads = decode_seqs.shape[0], q.shape[1], k_cache.shape[2]
    if num_decode == 0:
        return
    acc = torch.empty(num_decode, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(num_decode, num_heads, num_splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    _decode_split_kernel[(num_kv_heads, num_decode, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, decode_seqs, out, acc, m, l_sum,
        scale * _LOG2E, num_splits, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=_pow2(group),
        BLOCK_D=_pow2(head_dim), BLOCK_N=block_n, DOT_PRECISION=_precision(q.dtype), SLIDING=window is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits == 1:
        return  # the split kernel wrote the output itself
    _decode_reduce_kernel[(num_decode, num_heads)](
        out, acc, m, l_sum, query_start_loc, decode_seqs, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=MAX_SPLITS, BLOCK_D=_pow2(head_dim),  # one compiled variant for any split count
        num_warps=4,
    )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    tiles: torch.Tensor,  # [TILES_HEADER + 2 * capacity] int32: tile_buffer(plan_prefill_tiles(..., block_m))
    out: torch.Tensor,  # [T, H, D]: only the rows of the tiled sequences are written
    scale: float,
    block_m: int,
    num_programs: int | None = None,  # programs per head (a graph's fixed grid); default: one per tile
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int | None = None,  # a sliding window: query at position p reads keys p - window + 1..p; None: 0..p
) -> None:
    group, head_dim, block_size = check_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    check_window(window)
    if tiles.dtype != torch.int32 or tiles.dim() != 1 or not tiles.is_contiguous() or tiles.device != q.device:
        raise TypeError(
            f"tiles must be a contiguous 1-D int32 buffer on {q.device}; got {tiles.dtype} {tuple(tiles.shape)}"
        )
    capacity, odd = divmod(tiles.shape[0] - TILES_HEADER, 2)
    if capacity < 0 or odd:
        raise ValueError(f"tiles holds {tiles.shape[0]} ints: expected {TILES_HEADER} + 2 per tile (tile_buffer)")
    num_programs = capacity if num_programs is None else num_programs
    if num_programs == 0:
        return
    big = q.element_size() * _pow2(head_dim) > 256  # float32 or head_dim > 128: keep K/V stages in shared memory
    block_n = block_n or (32 if big else 64)
    num_warps = num_warps or (4 if block_m <= 64 else 8)
    num_stages = num_stages or (2 if big else 3)
    _prefill_kernel[(q.shape[1], num_programs)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, tiles, scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_D=_pow2(head_dim),
        BLOCK_N=block_n, DOT_PRECISION=_precision(q.dtype), TILES_HEADER=TILES_HEADER, SLIDING=window is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
