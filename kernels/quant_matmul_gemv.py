"""The decode-sized quantized linear layer: y = x W^T (+ b) for a few token rows, as a GEMV over the weight layout
of quant_matmul_ref.py, in one launch. `quant_matmul_ref` is its specification.

At decode sizes the weight's bytes are the cost, so the kernel only streams them: each program owns BLOCK_N
output rows, one token row and a contiguous slice of K; it loads 128 bytes of each weight row per K tile (16-byte
vectors of packed codes), shifts the codes out in registers, turns them into float32 without a conversion
instruction (a code OR'd into the mantissa of 2**23 is 2**23 + code), subtracts the zero point with that same
add, and accumulates products with the activations in float32 on the CUDA cores; each group's scale multiplies
its partial sum once per word. K is split over programs when the output rows alone would leave SMs idle; the
programs of one output tile write float32 partial sums and the last to finish (a counter per tile, reset by that
program, so the counters stay zero between calls and under CUDA graphs) adds them in split order and writes the
output: no zero-fill, no reduction kernel, no cast. Token rows are a grid axis: each re-reads the weight, which
is why the layer keeps this path to the smallest batches. Knows nothing of models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .quant_matmul import ACT_DTYPES, check_weight
from .quant_matmul_ref import quant_matmul_ref

__all__ = ["GemvPlan", "gemv_locks", "gemv_plan", "quant_gemv", "quant_matmul_ref"]

BLOCK_N = 32  # output rows per program: 32 rows x 128 bytes = four 16-byte vectors per thread of 2 warps
ROW_BYTES = 128  # bytes of each weight row a program loads per K tile
TARGET_PROGRAMS_PER_SM = 8  # split K until (token rows x output tiles x splits) reaches this many per SM:
# 64-thread programs, one 4 KB K tile in flight each; an SM holds up to 32 of them (starting point, to be tuned)
MAX_SPLIT = 16
NUM_WARPS = 2  # 4 rows a thread: each field's activations, loaded once, serve 4 rows
INTERPRETER_BLOCK_N = 128  # on CPU: Triton's interpreter pays per program and per op, not per element


@triton.jit
def _gemv_tile(
    w_rows, s_rows, z_rows, m_rows, x_row, t, n_mask, K, GROUPS,
    BITS: tl.constexpr, CODES: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr, GW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, MASK_K: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, G, GW] float32: K tile t's products, per word (or e4m3 byte), scaled by their group's scale.
    The tile is G groups (or parts of one group) of GW words of CODES codes each. Every tensor keeps the layout
    of the word load (codes are taken out one field at a time, not along a new axis), so nothing moves between
    threads; each field's activations are a strided [G, GW] load, shared by a thread's rows, from L1."""
    words_at = t * (G * GW) + tl.arange(0, G)[:, None] * GW + tl.arange(0, GW)[None, :]  # [G, GW] along the row
    group = (t * (G * GW * CODES)) // GROUP + tl.arange(0, G)  # [G] scale column of each group in the tile
    if MASK_K:  # the last, partial tile
        w_mask = n_mask[:, None, None] & (words_at < K // CODES)[None, :, :]
        g_mask = n_mask[:, None] & (group < GROUPS)[None, :]
    else:
        w_mask = n_mask[:, None, None]
        g_mask = n_mask[:, None]
    w_at = w_rows[:, :, None] + words_at[None, :, :]  # [BN, G, GW]
    scale = tl.load(s_rows + group[None, :], mask=g_mask, other=0.0).to(tl.float32)[:, :, None]  # [BN, G, 1]
    if BITS == 0:  # e4m3 values, one per byte (CODES == 1)
        if MASK_K:
            x = tl.load(x_row + words_at, mask=words_at < K, other=0.0)
        else:
            x = tl.load(x_row + words_at)
        x = x.to(tl.float32)[None, :, :]  # [1, G, GW]
        part = tl.load(w_at, mask=w_mask, other=0.0).to(tl.float32) * x
        x_sum = x
    else:
        words = tl.load(w_at, mask=w_mask, other=0)
        offset = 8388608.0  # 2**23: (2**23 + code) - offset is the code, exactly
        if HAS_ZEROS:
            zeros = tl.load(z_rows + group[None, :], mask=g_mask, other=0).to(tl.float32)[:, :, None]
            offset = offset + zeros  # [BN, G, 1]: code - zero point in the same add
        part = tl.zeros((w_at.shape[0], G, GW), dtype=tl.float32)
        x_sum = tl.zeros((1, G, GW), dtype=tl.float32)
        for f in tl.static_range(CODES):
            offs_k = words_at * CODES + f
            if MASK_K:
                x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0)
            else:
                x = tl.load(x_row + offs_k)
            x = x.to(tl.float32)[None, :, :]  # [1, G, GW]
            codes = (words >> (f * BITS)) & ((1 << BITS) - 1)  # sign bits masked off
            q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - offset  # 0x4B000000 is 2**23
            part += q * x
            if HAS_MINS:
                x_sum += x
    part = part * scale
    if HAS_MINS:  # w = q * s + m: the offsets meet the sum of the inputs
        mins = tl.load(m_rows + group[None, :], mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
        part += x_sum * mins
    return part


@triton.jit
def _quant_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, b_ptr, part_ptr, lock_ptr, out_ptr, N, K, GROUPS, tiles_per_split,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_mn, stride_om,
    BITS: tl.constexpr, CODES: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr, GW: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]  # [BN, 1]
    w_rows, s_rows = w_ptr + rows * stride_wn, s_ptr + rows * stride_sn
    z_rows, m_rows = z_ptr + rows * stride_zn, m_ptr + rows * stride_mn
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    full_tiles = K // (G * GW * CODES)
    t0 = pid_k * tiles_per_split
    acc = tl.zeros((BLOCK_N, G, GW), dtype=tl.float32)
    for t in range(t0, tl.minimum(t0 + tiles_per_split, full_tiles)):
        acc += _gemv_tile(
            w_rows, s_rows, z_rows, m_rows, x_row, t, n_mask, K, GROUPS,
            BITS, CODES, GROUP, G, GW, HAS_ZEROS, HAS_MINS, False,
        )  # fmt: skip
    if not EVEN_K:  # noqa: SIM102 (a compile-time test around a run-time one)
        if pid_k == SPLIT - 1:  # the launcher gives the last split the partial tile
            acc += _gemv_tile(
                w_rows, s_rows, z_rows, m_rows, x_row, full_tiles, n_mask, K, GROUPS,
                BITS, CODES, GROUP, G, GW, HAS_ZEROS, HAS_MINS, True,
            )  # fmt: skip
    total = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    out = out_ptr + row.to(tl.int64) * stride_om + offs_n
    if SPLIT == 1:
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        slabs = part_ptr + row * (SPLIT * N) + offs_n  # partial sums [M, SPLIT, N] float32
        tl.store(slabs + pid_k * N, total, mask=n_mask)
        tl.debug_barrier()  # every thread's partial sums are written before the counter is released
        lock = lock_ptr + row * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:  # the last of this tile's splits
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # split order: the result does not depend on which finished last
                total += tl.load(slabs + s * N, mask=n_mask, other=0.0, cache_modifier=".cg")  # from L2
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(lock, 0)  # zero again for the next call (and the next graph replay)


@dataclass(frozen=True)
class GemvPlan:
    """One launch's shape: a K tile is `groups` groups (or parts of one group) of `group_words` words."""

    groups: int  # G
    group_words: int  # GW: words (e4m3 bytes) of one group within a tile
    split: int  # programs along K per output tile
    tiles_per_split: int


def _tile_shape(k: int, group_size: int, kind: int) -> tuple[int, int] | None:
    """(G, GW) of the 128-byte K tile, or None where the groups neither cover whole tiles nor divide them
    into whole words (those layers take quant_matmul's GEMM)."""
    codes = 1 if kind == 0 else 32 // kind
    units = ROW_BYTES if kind == 0 else ROW_BYTES // 4  # bytes or int32 words per row per tile
    block_k = units * codes
    if group_size >= k or group_size % block_k == 0:
        return 1, units
    if block_k % group_size == 0 and group_size % codes == 0:
        return block_k // group_size, group_size // codes
    return None


def gemv_plan(
    m: int, n: int, k: int, kind: int, group_size: int, num_sms: int, split_k: int | None = None
) -> GemvPlan | None:
    """The launch for M = m token rows, or None where the groups do not fit the kernel's tiles. Splits K so the
    grid reaches TARGET_PROGRAMS_PER_SM programs per SM (at most MAX_SPLIT ways), each split whole tiles."""
    shape = _tile_shape(k, group_size, kind)
    if shape is None:
        return None
    g, gw = shape
    tiles_k = triton.cdiv(k, g * gw * (1 if kind == 0 else 32 // kind))
    if split_k is None:
        split_k = min(MAX_SPLIT, triton.cdiv(TARGET_PROGRAMS_PER_SM * num_sms, m * triton.cdiv(n, BLOCK_N)))
    per = triton.cdiv(tiles_k, max(1, min(split_k, tiles_k)))
    return GemvPlan(g, gw, triton.cdiv(tiles_k, per), per)


def gemv_locks(n: int, max_tokens: int, device: torch.device) -> torch.Tensor:
    """The zeroed counters `quant_gemv` needs for an N-output layer at up to `max_tokens` rows; a layer keeps
    one set (the kernel leaves them zero), so its calls launch nothing but the kernel."""
    return torch.zeros(max_tokens * triton.cdiv(n, BLOCK_N), dtype=torch.int32, device=device)


def quant_gemv(
    x: torch.Tensor,  # [M, K], rows may be strided
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    mins: torch.Tensor | None = None,
    split_k: int | None = None,  # None: chosen from the launch's size and the GPU's SM count
    locks: torch.Tensor | None = None,  # `gemv_locks`: None allocates zeroed counters (one more launch)
) -> torch.Tensor:  # [M, N] in x's dtype
    """x W^T (+ b), as `quant_matmul` computes it, for small M. Raises ValueError for group sizes the tiles do
    not fit (`gemv_plan` is None: use `quant_matmul`). Launch shapes depend on shapes only (CUDA graphs)."""
    from .quant_matmul import _num_sms

    n, k, kind = check_weight(qweight, scales, qzeros, mins, bits, group_size)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K={k}] with contiguous rows; got shape {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [N={n}]; got shape {tuple(bias.shape)}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if split_k is None and x.device.type != "cuda":
        split_k = 1  # the interpreter: no splits unless asked for
    plan = gemv_plan(m, n, k, kind, group_size, _num_sms(x.device), split_k)
    if plan is None:
        raise ValueError(f"group_size={group_size} neither covers nor divides the GEMV's K tiles: use quant_matmul")
    block_n = BLOCK_N if x.is_cuda else INTERPRETER_BLOCK_N
    n_tiles = triton.cdiv(n, block_n)
    part = out
    if plan.split > 1:
        part = torch.empty(m, plan.split, n, dtype=torch.float32, device=x.device)
        if locks is None:
            locks = torch.zeros(m * n_tiles, dtype=torch.int32, device=x.device)
        elif locks.dtype != torch.int32 or locks.numel() < m * n_tiles:
            raise ValueError(f"locks must be int32 with at least {m * n_tiles} counters (gemv_locks)")
    codes = 1 if kind == 0 else 32 // kind
    dummy = scales  # stands in for absent zero points, mins, bias and counters: never read
    _quant_gemv_kernel[(n_tiles, plan.split, m)](
        x, qweight, scales, dummy if qzeros is None else qzeros, dummy if mins is None else mins,
        dummy if bias is None else bias, part, dummy if locks is None else locks, out,
        n, k, scales.shape[1], plan.tiles_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), 0 if qzeros is None else qzeros.stride(0),
        0 if mins is None else mins.stride(0), out.stride(0),
        BITS=kind, CODES=codes, GROUP=group_size, G=plan.groups, GW=plan.group_words,
        HAS_ZEROS=qzeros is not None, HAS_MINS=mins is not None, HAS_BIAS=bias is not None, SPLIT=plan.split,
        EVEN_K=k % (plan.groups * plan.group_words * codes) == 0, BLOCK_N=block_n, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
