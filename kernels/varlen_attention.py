"""Attention over packed variable-length sequences without a KV cache, in Triton: flash-attention's varlen
forward. Sequence i owns rows `cu_seqlens[i]:cu_seqlens[i + 1]` of q, k and v ([T, heads, head_dim]); each
query attends to its own sequence's keys, all of them (an encoder's bidirectional attention) or, with
`causal`, those at or before it. GQA: query head h reads KV head h // (H // Hkv). head_dim up to 256.

One program per (query tile of BLOCK_M rows, sequence, head): it walks its sequence's keys BLOCK_N at a time
with an online softmax in float32 (exp2, the scale folded into log2 units), unmasked where every key of the
tile is visible to every row and masked on the edge tiles only (the sequence's end; with `causal`, the tiles
the diagonal crosses). The grid is sized by `max_seqlen` with no host planning: tiles past a shorter
sequence's end exit at once. `varlen_attention_ref` (varlen_attention_ref.py) is the specification. Knows
nothing of models or of the engine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .varlen_attention_ref import varlen_attention_ref

__all__ = ["DTYPES", "MAX_HEAD_DIM", "launch_config", "runs_in_interpreter", "varlen_attention", "varlen_attention_ref"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


@triton.jit
def _tile(
    q, m_i, l_i, acc, n0, offs_m, seq_len, k_base, v_base, stride_kt, stride_vt, qk_scale, d_mask,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys n0 .. n0 + BLOCK_N of the sequence (rows `offs_m` of it). MASKED:
    the tile holds keys past the sequence's end or, with CAUSAL, after some row's position."""
    pos = n0 + tl.arange(0, BLOCK_N)  # [N] key positions in the sequence
    if MASKED:
        in_seq = pos < seq_len
        kv_mask = in_seq[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    k = tl.load(k_base + pos[:, None].to(tl.int64) * stride_kt, mask=kv_mask, other=0.0)  # [N, D]
    v = tl.load(v_base + pos[:, None].to(tl.int64) * stride_vt, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
    if MASKED:
        visible = in_seq[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
    # Finite: the first tile walked holds key 0, which every row sees (causal rows sit at positions >= 0).
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_tiles"])
def _varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, qk_scale, num_tiles,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # A sequence's tiles are adjacent programs (they share its K/V in L2), its last (busiest, when causal) first.
    pid, head = tl.program_id(0), tl.program_id(1)
    seq = pid // num_tiles
    tile = num_tiles - 1 - pid % num_tiles
    start = tl.load(cu_ptr + seq).to(tl.int64)
    seq_len = (tl.load(cu_ptr + seq + 1) - tl.load(cu_ptr + seq)).to(tl.int32)
    q_lo = tile * BLOCK_M
    if q_lo >= seq_len:  # the grid covers max_seqlen; this sequence is shorter
        return
    offs_m = q_lo + tl.arange(0, BLOCK_M)  # [M] query positions in the sequence
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < seq_len
    if BLOCK_D == HEAD_DIM:
        d_mask = tl.full([BLOCK_D], 1, tl.int1)  # no padded dims: row-constant masks keep loads vectorised
    else:
        d_mask = offs_d < HEAD_DIM
    rows = start + offs_m.to(tl.int64)  # T * stride can pass 2**31
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [M, D]
    kv_head = head // GROUP
    k_base = k_ptr + start * stride_kt + kv_head * stride_kh + offs_d[None, :]
    v_base = v_ptr + start * stride_vt + kv_head * stride_vh + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        # Keys before q_lo are visible to every row of the tile; the rest up to its last row are masked.
        full_hi = (q_lo // BLOCK_N) * BLOCK_N
        kv_hi = tl.minimum(seq_len, q_lo + BLOCK_M)
    else:
        full_hi = (seq_len // BLOCK_N) * BLOCK_N
        kv_hi = seq_len
    for n0 in range(0, full_hi, BLOCK_N):
        m_i, l_i, acc = _tile(
            q, m_i, l_i, acc, n0, offs_m, seq_len, k_base, v_base, stride_kt, stride_vt, qk_scale, d_mask,
            BLOCK_N, False, CAUSAL, DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_hi, kv_hi, BLOCK_N):
        m_i, l_i, acc = _tile(
            q, m_i, l_i, acc, n0, offs_m, seq_len, k_base, v_base, stride_kt, stride_vt, qk_scale, d_mask,
            BLOCK_N, True, CAUSAL, DOT_PRECISION,
        )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def runs_in_interpreter() -> bool:
    """True when this module's kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_varlen_attention_kernel).__name__ == "InterpretedFunction"


def launch_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a dtype and head size; depends on nothing else. 16-bit:
    the fastest of a sweep on an H100 (64 sequences of U[128, 512] tokens, bench/kernels/bench_varlen_attention.py:
    BLOCK_M 64/128, BLOCK_N 32/64/128, 4/8 warps, 1-3 stages), within 8 % of each case's best."""
    if dtype == torch.float32 or head_dim > 128:  # 4-byte or wide rows: smaller key tiles fit shared memory
        return 64, 32, 4, 2
    if head_dim > 64:
        return 64, 64, 4, 2
    return 64, 64, 4, 3


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    out: torch.Tensor,
) -> tuple[int, int]:
    """Validates the inputs; returns (group, head_dim)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"expected q [T, H, D] and k/v [T, Hkv, D] of one shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or num_heads % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: the same T and D, Hkv dividing H")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is over the kernel's {MAX_HEAD_DIM}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype or out.dtype != q.dtype:
        raise TypeError(
            f"q, k, v and out must share one of float32, float16, bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}, "
            f"{out.dtype}"
        )
    if out.shape != q.shape:
        raise ValueError(f"out shape {tuple(out.shape)} must equal q shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1); got strides {t.stride()}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share one device")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise TypeError(
            f"cu_seqlens must be a 1-D int32 tensor on {q.device}; got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)} on {cu_seqlens.device}"
        )
    if cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must hold B + 1 >= 2 offsets (at least one sequence)")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen={max_seqlen!r} must be an int >= 1: the longest sequence's length")
    return num_heads // k.shape[1], head_dim


def varlen_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32 on q's device: 0, then each sequence's end row
    max_seqlen: int,  # the longest sequence (host int, no device sync): it sizes the grid, so never less
    scale: float,
    causal: bool,
    out: torch.Tensor | None = None,  # [T, H, D]; None: a new tensor
) -> torch.Tensor:
    """softmax(q k^T * scale) v within each sequence (see the module); returns `out`."""
    out = torch.empty_like(q) if out is None else out
    group, head_dim = _check(q, k, v, cu_seqlens, max_seqlen, out)
    if q.shape[0] == 0:
        return out
    block_m, block_n, num_warps, num_stages = launch_config(q.dtype, head_dim)
    num_tiles = triton.cdiv(max_seqlen, block_m)
    grid = ((cu_seqlens.shape[0] - 1) * num_tiles, q.shape[1])
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens, scale * _LOG2E, num_tiles,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # no TF32 rounding of float32 inputs
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
