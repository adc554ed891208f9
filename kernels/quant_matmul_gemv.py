"""The decode-sized linear layer: y = x W^T (+ b) for a few token rows, as a GEMV in one launch, over quantized
weights in the layout of quant_matmul_ref.py (`quant_gemv`; `quant_matmul_ref` is its specification) or over
plain 16-bit weights (`linear_gemv`; F.linear in float32 is its specification).

At decode sizes the weight's bytes are the cost, so the kernel only streams them: each program owns BLOCK_N
output rows, one token row and a contiguous slice of K; it loads ROW_BYTES of each weight row per K tile (16-byte
vectors), and for packed codes shifts them out in registers, turns them into float32 without a conversion
instruction (a code OR'd into a float's mantissa: `_gemv_tile`), takes the zero point off, and accumulates
products with the activations in float32 on the CUDA cores; each group's scale multiplies its partial sum
once per word. K is split over programs when the output rows alone would leave SMs idle; the
programs of one output tile write float32 partial sums and the last to finish (a counter per tile, reset by that
program, so the counters stay zero between calls and under CUDA graphs) adds them in split order and writes the
output: no zero-fill, no reduction kernel, no cast. Token rows are a grid axis: each re-reads the weight, which
is why the layers keep this path to the smallest batches. The tile and split come from a `GemvConfig`
(kernels/gemv_plan.py). Knows nothing of models.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .gemv_plan import (
    INTERPRETER_CONFIG,
    ROW_GROUP,
    GemvConfig,
    GemvPlan,
    codes_per_unit,
    config_for,
    float_kind,
    gemv_locks,
    gemv_plan,
)
from .gemv_prologue import ADD_RMS_NORM, NONE, RMS_NORM, SILU_MUL, activations, inv_rms
from .l2_prefetch import prefetch_rows_l2
from .pdl import pdl_launch
from .quant_matmul import ACT_DTYPES, _num_sms, check_weight
from .quant_matmul_ref import quant_matmul_ref

__all__ = [
    "GemvConfig",
    "GemvPlan",
    "gemv_locks",
    "gemv_plan",
    "linear_gemv",
    "quant_gemv",
    "quant_matmul_ref",
    "rms_norm_gemv",
    "silu_mul_gemv",
]


@triton.jit
def _gemv_tile(
    w_rows, s_rows, z_rows, m_rows, x_row, a_row, nw_ptr, rms, t, n_mask, K, GROUPS,
    BITS: tl.constexpr, CODES: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr, GW: tl.constexpr,
    HAS_SCALES: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, MASK_K: tl.constexpr,
    FOLD: tl.constexpr, PROLOGUE: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, G, GW] float32: K tile t's products, per word (or value), scaled by their group's scale.
    The tile is G groups (or parts of one group) of GW words of CODES codes each (BITS 0: one value per
    element, e4m3 with scales or plain floats without). Every tensor keeps the layout of the word load (codes
    are taken out one field at a time, not along a new axis), so nothing moves between threads; each field's
    activations are a strided [G, GW] load, shared by a thread's rows, from L1.

    A code becomes a float without a conversion instruction. Exact (FOLD off): OR'd into the mantissa of
    2**23 it is 2**23 + code, and one subtraction takes 2**23 and the zero point off: shift, mask-and-or,
    subtract, multiply-add, four instructions a code. Folded (FOLD on): OR'd into the top of the mantissa of
    1.0 it is 1 + code / 2**BITS, multiplied into the sum as it is; the 1 and the zero point are taken off
    once a word against the activations' sum (shared by a thread's rows): three instructions a code, the
    result a few float32 roundings less exact (both terms are of the products' size, so nothing cancels).
    A prologue (PROLOGUE, gemv_prologue.py) applies to the one-value kinds only."""
    words_at = t * (G * GW) + tl.arange(0, G)[:, None] * GW + tl.arange(0, GW)[None, :]  # [G, GW] along the row
    group = (t * (G * GW * CODES)) // GROUP + tl.arange(0, G)  # [G] scale column of each group in the tile
    if MASK_K:  # the last, partial tile
        w_mask = n_mask[:, None, None] & (words_at < K // CODES)[None, :, :]
        g_mask = n_mask[:, None] & (group < GROUPS)[None, :]
    else:
        w_mask = n_mask[:, None, None]
        g_mask = n_mask[:, None]
    w_at = w_rows[:, :, None] + words_at[None, :, :]  # [BN, G, GW]
    if HAS_SCALES:  # loaded first, as the words are: both in flight together
        scale = tl.load(s_rows + group[None, :], mask=g_mask, other=0.0).to(tl.float32)[:, :, None]  # [BN, G, 1]
    if BITS == 0:  # one value per element (CODES == 1): e4m3 bytes or plain floats
        # the activations, after the prologue (gemv_prologue.py) where there is one
        x = activations(x_row, a_row, nw_ptr, words_at, words_at < K, rms, K, PROLOGUE, MASK_K)[None, :, :]
        part = tl.load(w_at, mask=w_mask, other=0.0).to(tl.float32) * x
        x_sum = x
    else:
        words = tl.load(w_at, mask=w_mask, other=0)
        offset = 8388608.0  # 2**23: (2**23 + code) - offset is the code, exactly
        if FOLD:
            offset = 1.0  # 1 + code / 2**BITS, less 1, is code / 2**BITS
        if HAS_ZEROS:
            zeros = tl.load(z_rows + group[None, :], mask=g_mask, other=0).to(tl.float32)[:, :, None]
            if FOLD:
                zeros = zeros * (1.0 / (1 << BITS))
            offset = offset + zeros  # [BN, G, 1]: code - zero point in the same subtraction
        part = tl.zeros((w_at.shape[0], G, GW), dtype=tl.float32)
        x_sum = tl.zeros((1, G, GW), dtype=tl.float32)
        top = 23 - BITS  # FOLD: where a code sits in the mantissa
        for f in tl.static_range(CODES):
            offs_k = words_at * CODES + f
            if MASK_K:
                x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0)
            else:
                x = tl.load(x_row + offs_k)
            x = x.to(tl.float32)[None, :, :]  # [1, G, GW]
            if FOLD:
                if f * BITS <= top:
                    codes = (words << (top - f * BITS)) & (((1 << BITS) - 1) << top)
                else:
                    codes = (words >> (f * BITS - top)) & (((1 << BITS) - 1) << top)  # sign bits masked off
                part += (codes | 0x3F800000).to(tl.float32, bitcast=True) * x  # 0x3F800000 is 1.0
            else:
                codes = (words >> (f * BITS)) & ((1 << BITS) - 1)  # sign bits masked off
                q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - offset  # 0x4B000000 is 2**23
                part += q * x
            if HAS_MINS or FOLD:
                x_sum += x
        if FOLD:
            part = (part - offset * x_sum) * (1 << BITS)
    if HAS_SCALES:
        part = part * scale
    if HAS_MINS:  # w = q * s + m: the offsets meet the sum of the inputs
        mins = tl.load(m_rows + group[None, :], mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
        part += x_sum * mins
    return part


# One compiled variant per weight kind and tile whatever the layer's shape: no specialization on the split nor
# on the sizes the scales' rows take (stride_sn: K / group_size, odd or even by layer).
@triton.jit(
    do_not_specialize=[
        "GROUPS",
        "tiles_per_split",
        "split",
        "stride_sn",
        "stride_zn",
        "stride_mn",
        "eps",
        "stride_am",
        "stride_hm",
    ]
)
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, b_ptr, part_ptr, lock_ptr, out_ptr, a_ptr, nw_ptr, h_ptr, eps,
    N, K, GROUPS, tiles_per_split, split, stride_xm, stride_wn, stride_sn, stride_zn, stride_mn, stride_om,
    stride_am, stride_hm,
    BITS: tl.constexpr, CODES: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr, GW: tl.constexpr,
    HAS_SCALES: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, FOLD: tl.constexpr, PROLOGUE: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    full_tiles = K // (G * GW * CODES)
    t0 = pid_k * tiles_per_split
    if PDL:  # launched as a programmatic dependent (kernels/pdl.py): nothing read before the last kernel's writes land
        # The weights are no kernel's writes: L2 streams this program's while it waits (kernels/l2_prefetch.py).
        if PREFETCH:  # noqa: SIM102 (a compile-time test around a run-time one)
            if row == 0:  # the other token rows' programs read the same words
                words_end = tl.minimum(t0 + tiles_per_split, full_tiles) * (G * GW)
                words_end = tl.where(pid_k == split - 1, K // CODES, words_end)  # the partial tile is the last's
                item: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
                rows_at = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
                prefetch_rows_l2(rows_at, t0 * (G * GW), words_end - t0 * (G * GW), 16, item)
        tl.extra.cuda.gdc_wait()
    rows = offs_n.to(tl.int64)[:, None]  # [BN, 1]
    w_rows, s_rows = w_ptr + rows * stride_wn, s_ptr + rows * stride_sn
    z_rows, m_rows = z_ptr + rows * stride_zn, m_ptr + rows * stride_mn
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    a_row = a_ptr + row.to(tl.int64) * stride_am  # the residual (ADD_RMS_NORM)
    rms = 1.0
    # the whole row's rms, by every program (K <= 8192); Triton's frontend has no `in`
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:  # noqa: SIM109
        h_limit = tl.where((pid_n == 0) & (pid_k == 0), K, 0)  # the new residual's one writer
        rms = inv_rms(x_row, a_row, h_ptr + row.to(tl.int64) * stride_hm, K, eps, h_limit, PROLOGUE)
    if PDL:  # the next kernel may start launching; it waits (gdc_wait) for this one to finish
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, G, GW), dtype=tl.float32)
    for t in range(t0, tl.minimum(t0 + tiles_per_split, full_tiles)):
        acc += _gemv_tile(
            w_rows, s_rows, z_rows, m_rows, x_row, a_row, nw_ptr, rms, t, n_mask, K, GROUPS,
            BITS, CODES, GROUP, G, GW, HAS_SCALES, HAS_ZEROS, HAS_MINS, False, FOLD, PROLOGUE,
        )  # fmt: skip
    if not EVEN_K:  # noqa: SIM102 (a compile-time test around a run-time one)
        if pid_k == split - 1:  # the launcher gives the last split the partial tile
            acc += _gemv_tile(
                w_rows, s_rows, z_rows, m_rows, x_row, a_row, nw_ptr, rms, full_tiles, n_mask, K, GROUPS,
                BITS, CODES, GROUP, G, GW, HAS_SCALES, HAS_ZEROS, HAS_MINS, True, FOLD, PROLOGUE,
            )  # fmt: skip
    total = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    out = out_ptr + row.to(tl.int64) * stride_om + offs_n
    if split == 1:
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        slabs = part_ptr + row.to(tl.int64) * split * N + offs_n  # partial sums [M, split, N] float32
        tl.store(slabs + pid_k * N, total, mask=n_mask)
        tl.debug_barrier()  # every thread's partial sums are written before the counter is released
        lock = lock_ptr + row * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == split - 1:  # the last of this tile's splits
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(split):  # split order: the result does not depend on which finished last
                total += tl.load(slabs + s * N, mask=n_mask, other=0.0, cache_modifier=".cg")  # from L2
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(lock, 0)  # zero again for the next call (and the next graph replay)


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
    split_k: int | None = None,  # None: chosen from the launch's size, the config and the GPU's SM count
    locks: torch.Tensor | None = None,  # `gemv_locks`: None allocates zeroed counters (one more launch)
    config: GemvConfig | None = None,  # None: the layer shape's tuned config (gemv_plan.config_for)
) -> torch.Tensor:  # [M, N] in x's dtype
    """x W^T (+ b), as `quant_matmul` computes it, for small M. Raises ValueError for group sizes the tiles do
    not fit (`gemv_plan` is None: use `quant_matmul`). Launch shapes depend on shapes only (CUDA graphs)."""
    n, k, kind = check_weight(qweight, scales, qzeros, mins, bits, group_size)
    out = _checked_output(x, n, k, bias)
    if x.shape[0]:
        _launch(x, qweight, scales, qzeros, mins, bias, out, kind, group_size, split_k, locks, config)
    return out


def linear_gemv(
    x: torch.Tensor,  # [M, K], rows may be strided
    weight: torch.Tensor,  # [N, K] with contiguous rows, x's dtype
    bias: torch.Tensor | None = None,  # [N]
    *,
    split_k: int | None = None,
    locks: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,  # a programmatic dependent launch (CUDA, Hopper or newer): kernels/pdl.py
    prefetch: bool = False,  # with pdl: each program asks L2 for its weights before it waits on the kernel before
) -> torch.Tensor:  # [M, N] in x's dtype
    """F.linear(x, weight, bias) for small M over a plain float weight (bfloat16 or float16; float32 for the
    interpreter's tests): products and sums in float32, rounded once to x's dtype. Arguments as `quant_gemv`'s."""
    n, k = _checked_weight(x, weight)
    out = _checked_output(x, n, k, bias)
    if x.shape[0]:
        _launch(x, weight, None, None, None, bias, out, float_kind(weight.dtype), k, split_k, locks, config,
                pdl=pdl, prefetch=prefetch)  # fmt: skip
    return out


def rms_norm_gemv(
    x: torch.Tensor,  # [M, K]: the norm's input
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K] with contiguous rows, x's dtype
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,  # [M, K]: the norm runs over x + residual
    split_k: int | None = None,
    locks: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
    prefetch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([M, N], the new residual [M, K] or None)
    """F.linear(rms_norm_ref(x, norm_weight, eps), weight, bias) in one launch (`rms_norm_gemv_ref`); with
    `residual`, h = x + residual is normed and returned as a new tensor (x and residual are left as they are:
    every program reads them, so none may write them). transformers' RMSNorm form (not Gemma's)."""
    n, k = _checked_weight(x, weight)
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous [K={k}] of x's dtype {x.dtype}; got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")  # fmt: skip
    h = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"residual must be [M, K] = {tuple(x.shape)} of x's dtype with contiguous rows; got "
                             f"{tuple(residual.shape)} {residual.dtype}")  # fmt: skip
        h = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = _checked_output(x, n, k, bias)
    if x.shape[0]:
        prologue = _Prologue(RMS_NORM.value if h is None else ADD_RMS_NORM.value, residual, norm_weight, h, eps)
        _launch(x, weight, None, None, None, bias, out, float_kind(weight.dtype), k, split_k, locks, config,
                prologue, pdl, prefetch)  # fmt: skip
    return out, h


def silu_mul_gemv(
    x: torch.Tensor,  # [M, 2 K]: [gate | up], rows may be strided
    weight: torch.Tensor,  # [N, K] with contiguous rows, x's dtype
    bias: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
    locks: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
    prefetch: bool = False,
) -> torch.Tensor:  # [M, N]
    """F.linear(silu_and_mul_ref(x), weight, bias) in one launch (`silu_mul_gemv_ref`)."""
    if weight.dim() != 2 or x.dim() != 2 or x.shape[1] != 2 * weight.shape[1] or x.stride(1) != 1:
        raise ValueError(f"x must be [M, 2 K] = [M, {2 * weight.shape[-1]}] ([gate | up]) with contiguous rows "
                         f"for a weight of shape {tuple(weight.shape)}; got x {tuple(x.shape)}")  # fmt: skip
    n, k = _checked_weight(x[:, : weight.shape[1]], weight)
    out = _checked_output(x[:, :k], n, k, bias)
    if x.shape[0]:
        prologue = _Prologue(SILU_MUL.value, None, None, None, 0.0)
        _launch(x, weight, None, None, None, bias, out, float_kind(weight.dtype), k, split_k, locks, config,
                prologue, pdl, prefetch)  # fmt: skip
    return out


def _checked_weight(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, K] with contiguous rows; got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} and x {x.dtype}; expected the same")
    return weight.shape[0], weight.shape[1]


class _Prologue(NamedTuple):
    """What a launch folds in before the GEMV (gemv_prologue.py): the mode and its operands."""

    mode: int
    residual: torch.Tensor | None
    norm_weight: torch.Tensor | None
    h: torch.Tensor | None  # the new residual, written by one program per token row
    eps: float


_NO_PROLOGUE = _Prologue(NONE.value, None, None, None, 0.0)


def _checked_output(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K={k}] with contiguous rows; got shape {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [N={n}]; got shape {tuple(bias.shape)}")
    return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)


def _launch(
    x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, qzeros: torch.Tensor | None,
    mins: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor, kind: int, group_size: int,
    split_k: int | None, locks: torch.Tensor | None, config: GemvConfig | None,
    prologue: _Prologue = _NO_PROLOGUE, pdl: bool = False, prefetch: bool = False,
) -> None:  # fmt: skip
    m, n, k = x.shape[0], out.shape[1], x.shape[1] // (2 if prologue.mode == SILU_MUL.value else 1)
    if config is None:
        config = config_for(kind, n, k) if x.is_cuda else INTERPRETER_CONFIG
    if split_k is None and not x.is_cuda:
        split_k = 1  # the interpreter: no splits unless asked for
    plan = gemv_plan(m, n, k, kind, group_size, _num_sms(x.device), split_k, config)
    if plan is None:
        raise ValueError(f"group_size={group_size} neither covers nor divides the GEMV's K tiles: use quant_matmul")
    n_tiles = triton.cdiv(n, config.block_n)
    part = out
    if locks is None:  # unread at one split, but the compiler types the counters' atomics whatever the split
        locks = (torch.zeros if plan.split > 1 else torch.empty)(
            m * n_tiles if plan.split > 1 else 1, dtype=torch.int32, device=x.device
        )
    if locks.dtype != torch.int32 or (plan.split > 1 and locks.numel() < m * n_tiles):
        raise ValueError(f"locks must be int32 with at least {m * n_tiles} counters (gemv_locks)")
    if plan.split > 1:
        part = torch.empty(m, plan.split, n, dtype=torch.float32, device=x.device)
    codes = codes_per_unit(kind)
    dummy = w  # stands in for absent scales, zero points, mins and bias: never read
    res, nw, h = prologue.residual, prologue.norm_weight, prologue.h
    _gemv_kernel[(n_tiles, plan.split, m)](
        x, w, dummy if scales is None else scales, dummy if qzeros is None else qzeros,
        dummy if mins is None else mins, dummy if bias is None else bias, part, locks,
        out, x if res is None else res, x if nw is None else nw, x if h is None else h, prologue.eps,
        n, k, 1 if scales is None else scales.shape[1], plan.tiles_per_split, plan.split,
        x.stride(0), w.stride(0), 0 if scales is None else scales.stride(0), 0 if qzeros is None else qzeros.stride(0),
        0 if mins is None else mins.stride(0), out.stride(0), 0 if res is None else res.stride(0),
        0 if h is None else h.stride(0),
        BITS=kind if codes > 1 else 0, CODES=codes, GROUP=ROW_GROUP if group_size >= k else group_size,
        G=plan.groups, GW=plan.group_words,
        HAS_SCALES=scales is not None, HAS_ZEROS=qzeros is not None, HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None, EVEN_K=k % (plan.groups * plan.group_words * codes) == 0,
        BLOCK_N=config.block_n, FOLD=config.fold_offsets and codes > 1, PROLOGUE=prologue.mode, PDL=pdl,
        PREFETCH=pdl and prefetch, num_warps=config.num_warps, **pdl_launch(pdl),
    )  # fmt: skip
