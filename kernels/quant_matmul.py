"""Quantized linear layers in Triton: y = x W^T (+ b) with W in the layout of quant_matmul_ref.py (integer codes
packed along K with group scales and zero points or mins, or e4m3 values with group scales), dequantized in
registers.

`quant_matmul` is the weight-only GEMM (W4A16 / W8A16): each program loads a K tile of packed words once,
shifts the codes out, and accumulates tl.dot in float32. Where one scale covers the tile (groups of 128 and
more, or one per row) the codes (less zero points) and e4m3 values enter the dot as they are, exact in 16
bits, and the scale multiplies the dot's float32 result; smaller groups are dequantized in float32 group by
group and rounded to the activations' dtype. K is split over several programs when the output tiles alone
would leave the GPU idle (decode-sized M); the bytes read are the packed weight's. `dequantize` writes the
whole weight in the activations' dtype for the large-M path (dequantize, then a cuBLAS GEMM). Both agree with
`quant_matmul_ref` / `dequantize_ref` (quant_matmul_ref.py), the specification, within the rounding of the
activations' dtype. Knows nothing of models."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .quant_matmul_ref import FP8_DTYPE, codes_per_word, dequantize_ref, quant_matmul_ref

__all__ = ["check_weight", "dequantize", "dequantize_ref", "quant_matmul", "quant_matmul_ref"]

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, z_ptr, m_ptr, offs_k, offs_n, mask, stride_wn, stride_sn, stride_zn, stride_mn,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
):  # fmt: skip
    """[BLOCK_K, BLOCK_N] float32: W^T's tile of inputs offs_k and outputs offs_n, dequantized (0 where masked)."""
    if BITS == 0:  # e4m3 values, one per byte
        q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0.0).to(tl.float32)
    else:
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // (32 // BITS)), mask=mask, other=0)
        codes = (words >> ((offs_k[:, None] % (32 // BITS)) * BITS)) & ((1 << BITS) - 1)  # sign bits masked off
        if HAS_ZEROS:
            zeros = tl.load(z_ptr + offs_n[None, :] * stride_zn + (offs_k[:, None] // GROUP), mask=mask, other=0)
            codes = codes - zeros.to(tl.int32)
        q = codes.to(tl.float32)
    groups = offs_k[:, None] // GROUP
    w = q * tl.load(s_ptr + offs_n[None, :] * stride_sn + groups, mask=mask, other=0.0).to(tl.float32)
    if HAS_MINS:
        w += tl.load(m_ptr + offs_n[None, :] * stride_mn + groups, mask=mask, other=0.0).to(tl.float32)
    return w


# How a K tile meets the scale groups (the launcher picks one per layer, the kernel's MODE): a row's one group,
# scaled after the whole K loop; groups of whole tiles, scaled once per tile after its dot; tiles of whole
# groups, dequantized group by group; anything else, per element. (Literals in the kernel: a jit function
# reads no plain module global.)
ROW, TILE, GROUPS, GATHER = 0, 1, 2, 3


@triton.jit
def _codes_tile(w_ptr, k0, offs_n, n_mask, K, stride_wn, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """[BLOCK_K, BLOCK_N] codes of inputs k0 .. k0 + BLOCK_K - 1: int32 (each word loaded once, its fields
    shifted out and laid along K) or float32 e4m3 values; 0 past K and past N."""
    if BITS == 0:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_k < K)[:, None] & n_mask[None, :]
        tile = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0.0).to(tl.float32)
    else:
        offs_w = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))
        mask = (offs_w < K // (32 // BITS))[:, None] & n_mask[None, :]
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_w[:, None], mask=mask, other=0)  # [BK / P, BN]
        shifts = tl.arange(0, 32 // BITS) * BITS
        codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [BK / P, P, BN], sign bits off
        tile = tl.reshape(codes, (BLOCK_K, BLOCK_N))  # input k = word * P + field
    return tile


@triton.jit
def _group_row(ptr, group, offs_n, n_mask, stride_n):
    """[BLOCK_N] float32: one group's scale (or min) of each output."""
    return tl.load(ptr + offs_n * stride_n + group, mask=n_mask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["split_k"])
def _quant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, m_ptr, b_ptr, out_ptr, M, N, K, split_k,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_mn, stride_om, stride_os,
    BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # ROW with mins: sum of each row's inputs
    for k0 in range(pid_k * BLOCK_K, K, split_k * BLOCK_K):  # this program's share of K (every split_k-th tile)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        if MODE == 3:  # GATHER
            w = _weight_tile(
                w_ptr, s_ptr, z_ptr, m_ptr, offs_k, offs_n, k_mask[:, None] & n_mask[None, :], stride_wn,
                stride_sn, stride_zn, stride_mn, BITS, GROUP, HAS_ZEROS, HAS_MINS,
            )  # fmt: skip
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
        elif MODE == 2:  # GROUPS: BLOCK_K // GROUP whole groups: dequantize in float32, one scale row per group
            q = tl.reshape(
                _codes_tile(w_ptr, k0, offs_n, n_mask, K, stride_wn, BITS, BLOCK_K, BLOCK_N),
                (BLOCK_K // GROUP, GROUP, BLOCK_N),
            )  # fmt: skip
            offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            g_mask = (offs_g * GROUP < K)[:, None] & n_mask[None, :]
            at = offs_n[None, :] * stride_sn + offs_g[:, None]
            if HAS_ZEROS:
                zeros = tl.load(z_ptr + offs_n[None, :] * stride_zn + offs_g[:, None], mask=g_mask, other=0)
                q = q - zeros.to(tl.int32)[:, None, :]
            w = q.to(tl.float32) * tl.load(s_ptr + at, mask=g_mask, other=0.0).to(tl.float32)[:, None, :]
            if HAS_MINS:
                w += tl.load(m_ptr + offs_n[None, :] * stride_mn + offs_g[:, None], mask=g_mask, other=0.0).to(
                    tl.float32
                )[:, None, :]
            w = tl.reshape(w, (BLOCK_K, BLOCK_N))
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
        else:  # ROW or TILE: one group over the tile; integer codes (less zero points) and e4m3 values are exact
            # in 16 bits, so the dot reads them as they are and the scale multiplies its float32 result
            q = _codes_tile(w_ptr, k0, offs_n, n_mask, K, stride_wn, BITS, BLOCK_K, BLOCK_N)
            group = k0 // GROUP
            if HAS_ZEROS:
                q = q - tl.load(z_ptr + offs_n * stride_zn + group, mask=n_mask, other=0).to(tl.int32)[None, :]
            part = tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)  # [BM, BN]
            if MODE == 0:  # ROW
                acc += part
                if HAS_MINS:
                    x_sum += tl.sum(x.to(tl.float32), axis=1)
            else:
                acc += part * _group_row(s_ptr, group, offs_n, n_mask, stride_sn)[None, :]
                if HAS_MINS:
                    row_sum = tl.sum(x.to(tl.float32), axis=1)
                    acc += row_sum[:, None] * _group_row(m_ptr, group, offs_n, n_mask, stride_mn)[None, :]
    if MODE == 0:  # ROW
        acc = acc * _group_row(s_ptr, 0, offs_n, n_mask, stride_sn)[None, :]
        if HAS_MINS:
            acc += x_sum[:, None] * _group_row(m_ptr, 0, offs_n, n_mask, stride_mn)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:  # float32 partial sums, one slab per split, added up by the launcher
        out = out_ptr + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, z_ptr, m_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_zn, stride_mn, stride_on,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    w = _weight_tile(
        w_ptr, s_ptr, z_ptr, m_ptr, offs_k, offs_n, mask, stride_wn, stride_sn, stride_zn, stride_mn,
        BITS, GROUP, HAS_ZEROS, HAS_MINS,
    )  # fmt: skip
    out = out_ptr + offs_n.to(tl.int64)[None, :] * stride_on + offs_k[:, None]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def check_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> tuple[int, int, int]:
    """(N, K, BITS constexpr) of a weight in the reference layout; raises naming what is wrong."""
    if qweight.dim() != 2 or qweight.stride(1) != 1:
        raise ValueError(f"qweight must be 2-D with contiguous rows; got shape {tuple(qweight.shape)}")
    n = qweight.shape[0]
    if qweight.dtype == FP8_DTYPE:
        k, kind = qweight.shape[1], 0
    elif qweight.dtype == torch.int32:
        k, kind = qweight.shape[1] * codes_per_word(bits), bits
    else:
        raise TypeError(f"qweight has dtype {qweight.dtype}; expected int32 (packed codes) or float8_e4m3fn")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    groups = -(-k // group_size)
    if tuple(scales.shape) != (n, groups) or scales.stride(1) != 1:
        raise ValueError(f"scales must be [N, ceil(K / group_size)] = {(n, groups)} with contiguous rows")
    if qzeros is not None:
        if kind == 0:
            raise ValueError("e4m3 weights have no zero points")
        if tuple(qzeros.shape) != (n, groups) or qzeros.dtype != torch.uint8 or qzeros.stride(1) != 1:
            raise ValueError(f"qzeros must be uint8 [N, ceil(K / group_size)] = {(n, groups)} with contiguous rows")
    if mins is not None:
        if qzeros is not None or kind == 0:
            raise ValueError("mins go with integer codes without zero points")
        if tuple(mins.shape) != (n, groups) or mins.stride(1) != 1:
            raise ValueError(f"mins must be [N, ceil(K / group_size)] = {(n, groups)} with contiguous rows")
    return n, k, kind


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # no TF32 rounding for float32 activations


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no splits unless asked for
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _mode(k: int, group_size: int, block_k: int, kind: int) -> int:
    """How this layer's groups meet the kernel's K tiles (ROW, TILE, GROUPS, GATHER above)."""
    if group_size >= k:
        return ROW
    if group_size % block_k == 0:
        return TILE
    if block_k % group_size == 0 and (kind == 0 or group_size % (32 // kind) == 0):
        return GROUPS
    return GATHER


def _config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by token count: decode sizes read the weight in long K strips;
    larger ones tile M for reuse. Starting points, to be tuned on the GPU (bench/quant_bench.py)."""
    if m <= 16:
        return 16, 64, 128, 4
    if m <= 32:
        return 32, 64, 128, 4
    if m <= 64:
        return 64, 64, 64, 4
    return 64, 128, 64, 8


def quant_matmul(
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
) -> torch.Tensor:  # [M, N] in x's dtype
    """x W^T (+ b) for W in the reference layout (quant_matmul_ref.py). Launch shapes depend on shapes only,
    so a call can be captured in a CUDA graph."""
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
    block_m, block_n, block_k, warps = _config(m)
    grid_m, grid_n, tiles_k = triton.cdiv(m, block_m), triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    if split_k is None:
        want = 2 * _num_sms(x.device)  # programs enough to keep every SM streaming weights
        split_k = min(triton.next_power_of_2(triton.cdiv(want, grid_m * grid_n)), max(1, tiles_k // 2), 16)
    split_k = max(1, min(split_k, tiles_k))
    partial = split_k > 1
    mode = _mode(k, group_size, block_k, kind)
    target = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if partial else out
    dummy = scales  # stands in for absent zero points, mins and bias: never read
    _quant_matmul_kernel[(grid_m, grid_n, split_k)](
        x, qweight, scales, dummy if qzeros is None else qzeros, dummy if mins is None else mins,
        dummy if bias is None else bias, target, m, n, k, split_k,
        x.stride(0), qweight.stride(0), scales.stride(0), 0 if qzeros is None else qzeros.stride(0),
        0 if mins is None else mins.stride(0), target.stride(-2), target.stride(0) if partial else 0,
        BITS=kind, GROUP=group_size, MODE=mode, HAS_ZEROS=qzeros is not None, HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None, PARTIAL=partial,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=_precision(x.dtype),
        num_warps=warps, num_stages=3,
    )  # fmt: skip
    if partial:
        total = target.sum(dim=0)  # [M, N] float32
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, *, bits: int, group_size: int,
    dtype: torch.dtype, mins: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The weight [N, K] in `dtype`: `dequantize_ref` rounded once to `dtype`."""
    n, k, kind = check_weight(qweight, scales, qzeros, mins, bits, group_size)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_k = 32, 128
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, scales if qzeros is None else qzeros, scales if mins is None else mins, out, n, k,
        qweight.stride(0), scales.stride(0), 0 if qzeros is None else qzeros.stride(0),
        0 if mins is None else mins.stride(0), out.stride(0),
        BITS=kind, GROUP=group_size, HAS_ZEROS=qzeros is not None, HAS_MINS=mins is not None,
        BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out
