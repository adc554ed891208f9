"""Everything between the qkv projection and attention, in one Triton pass: split the packed qkv, per-head
RMSNorm of q and k (Qwen3, or Gemma 3's (1 + w) form with `unit_offset`; skipped without weights), rotate-half
rotary embeddings, and the paged KV store (in an FP8 cache: k / k_scale and v / v_scale as e4m3 codes).

`qk_norm_rope_kv_ref` (qk_norm_rope_kv_ref.py) is the specification, the model code op for op (RMSNorm as
transformers orders it, rotary with cos/sin cast to the activations' dtype, every elementwise op rounded to it,
then store_kv).
Knows the KV cache layout [num_blocks, block_size, Hkv, D] and slot = block * block_size + row; nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_cache_fp8_ref import KV_FP8_DTYPE, check_kv_scales
from .pdl import pdl_launch
from .qk_norm_rope_kv_ref import qk_norm_rope_kv_ref
from .rms_norm import DTYPES

__all__ = ["qk_norm_rope_kv", "qk_norm_rope_kv_ref"]

_E4M3_MAX = tl.constexpr(448.0)  # e4m3fn's largest finite value


@triton.jit
def _norm_halves(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """RMSNorm of each row of a tile split in halves x1, x2 [R, BH] (padding holds 0), weights w1, w2 [R, BH]
    float32; rounded like transformers: normalise in float32, cast to x's dtype, multiply by the weight; or
    (UNIT_OFFSET, Gemma) multiply by 1 + weight in float32 and cast once."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM  # [R]
    rstd = tl.math.rsqrt(var + eps)[:, None]
    if UNIT_OFFSET:
        n1 = (f1 * rstd * (1.0 + w1)).to(dtype)
        n2 = (f2 * rstd * (1.0 + w2)).to(dtype)
    else:
        n1 = (w1 * (f1 * rstd).to(dtype).to(tl.float32)).to(dtype)
        n2 = (w2 * (f2 * rstd).to(dtype).to(tl.float32)).to(dtype)
    return n1, n2


@triton.jit
def _rotate(x1, x2, cos, sin):
    """(x1*cos - x2*sin, x2*cos + x1*sin) with each product and sum rounded to x's dtype, as torch does."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    a = (f1 * cos).to(dtype).to(tl.float32)
    b = (f2 * sin).to(dtype).to(tl.float32)
    c = (f2 * cos).to(dtype).to(tl.float32)
    d = (f1 * sin).to(dtype).to(tl.float32)
    return (a - b).to(dtype), (c + d).to(dtype)


@triton.jit
def _e4m3(x, scale):
    """x / scale (IEEE division) saturated to +-448 and rounded to e4m3's nearest value, ties to even, still in
    float32: torch's cast of the clamped quotient (kv_cache_fp8_ref.quantize_kv), so the cast to e4m3 that
    follows is exact. Rounded here with two float32 adds because Triton's CPU interpreter rounds a float32 ->
    e4m3 cast half up without carrying into the exponent (31.46 -> 16): done by the cast, the kernel could not
    be checked on CPU."""
    xf = x.to(tl.float32)
    y = tl.minimum(tl.maximum(tl.math.div_rn(xf, tl.broadcast_to(scale, xf.shape)), -_E4M3_MAX), _E4M3_MAX)
    # e4m3 keeps 3 mantissa bits, with exponents down to 2**-6 (float32's biased 121; below it a fixed step of
    # 2**-9): 1.5 * 2**(exponent + 20) has y's e4m3 step as its ulp, so y + magic rounds y to that step.
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 121)
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (y + magic) - magic
    return tl.where(y < 0, -tl.abs(rounded), rounded)  # -0 stays -0, as the cast keeps it


@triton.jit
def _qk_norm_rope_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr,
    k_scale_ptr, v_scale_ptr, eps,  # the scales: an FP8 cache's float32 ones (unread otherwise)
    stride_qkv, stride_cos, stride_sin, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_qo_t, stride_qo_h,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched as a programmatic dependent: the previous kernel's writes land before any read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next may launch now; it waits for this one the same way
    # One program per (token, KV head). Its GQA group's query heads and its key head form one tile of GROUP + 1
    # rows (queries first, the key last), normed and rotated together; the value head is copied alongside.
    token, kv_head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    HALF = HEAD_DIM // 2
    rows = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BH]; rotate-half pairs column j with j + D/2
    is_q = (rows < GROUP)[:, None]  # [R, 1]
    is_k = (rows == GROUP)[:, None]
    d_mask = offs_d < HALF
    src_head = tl.where(rows < GROUP, kv_head * GROUP + rows, NUM_HEADS + kv_head)[:, None]  # [R, 1] in qkv
    src = qkv_ptr + token * stride_qkv + src_head * HEAD_DIM + offs_d  # [R, BH]
    mask = (is_q | is_k) & d_mask
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_NORM:
        q_w1 = tl.load(q_w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)  # [1, BH]
        q_w2 = tl.load(q_w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        k_w1 = tl.load(k_w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        k_w2 = tl.load(k_w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        q_or_k_w1, q_or_k_w2 = tl.where(is_q, q_w1, k_w1), tl.where(is_q, q_w2, k_w2)
        x1, x2 = _norm_halves(x1, x2, q_or_k_w1, q_or_k_w2, eps, HEAD_DIM, UNIT_OFFSET)
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)  # [1, BH] float32 or dtype
    sin = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=d_mask, other=0.0)
    # The model casts the tables to the activations' dtype before rotating.
    x1, x2 = _rotate(x1, x2, cos.to(dtype).to(tl.float32), sin.to(dtype).to(tl.float32))

    q_dst = q_out_ptr + token * stride_qo_t + (kv_head * GROUP + rows)[:, None] * stride_qo_h + offs_d
    tl.store(q_dst, x1, mask=is_q & d_mask)
    tl.store(q_dst + HALF, x2, mask=is_q & d_mask)

    slot = tl.load(slot_ptr + token)  # int64; -1 marks a padding token (CUDA graphs): no cache write
    block, block_row = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    # Broadcast the scalar test to a tile before combining (the interpreter cannot `&` a scalar with a tile).
    keep = (offs_d * 0 + slot) >= 0  # [1, BH]
    k_dst = k_cache_ptr + block * stride_kb + block_row * stride_kt + kv_head * stride_kh + offs_d  # [1, BH]
    k_dst = tl.broadcast_to(k_dst, (BLOCK_R, BLOCK_HALF))  # a pointer per tile element; only the key row stores
    v_src = qkv_ptr + token * stride_qkv + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d
    v_dst = v_cache_ptr + block * stride_vb + block_row * stride_vt + kv_head * stride_vh + offs_d
    v1, v2 = tl.load(v_src, mask=d_mask), tl.load(v_src + HALF, mask=d_mask)
    if KV_FP8:
        k_scale, v_scale = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
        codes = k_cache_ptr.dtype.element_ty
        x1, x2 = _e4m3(x1, k_scale).to(codes), _e4m3(x2, k_scale).to(codes)
        v1, v2 = _e4m3(v1, v_scale).to(codes), _e4m3(v2, v_scale).to(codes)
    tl.store(k_dst, x1, mask=is_k & d_mask & keep)
    tl.store(k_dst + HALF, x2, mask=is_k & d_mask & keep)
    tl.store(v_dst, v1, mask=d_mask & keep)
    tl.store(v_dst + HALF, v2, mask=d_mask & keep)


def _check(qkv, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps):
    """Validates the inputs but an FP8 cache's scales; returns (num_heads, num_kv_heads, head_dim)."""
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be 2-D [T, (H + 2 * Hkv) * D]; got shape {tuple(qkv.shape)}")
    if qkv.dtype not in DTYPES:
        raise TypeError(f"qkv has dtype {qkv.dtype}; expected one of float32, float16, bfloat16")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must be [num_blocks, block_size, Hkv, D] of one shape; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim % 2 or qkv.shape[1] % head_dim or qkv.shape[1] // head_dim <= 2 * num_kv_heads:
        raise ValueError(
            f"qkv width {qkv.shape[1]} must be (H + 2 * Hkv) * D with the cache's Hkv={num_kv_heads}, "
            f"D={head_dim} (even) and H >= 1"
        )
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of the cache's {num_kv_heads} KV heads")
    # The tables may already be in qkv's dtype (a model cast with `.to(dtype)` casts its buffers): the kernel
    # casts float32 tables to that dtype first, so both give the same rotation.
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if table.dim() != 2 or table.shape[1] != head_dim // 2 or table.dtype not in (torch.float32, qkv.dtype):
            raise ValueError(
                f"{name} must be float32 or {qkv.dtype} [P, D/2] = [P, {head_dim // 2}]; got {table.dtype} "
                f"{tuple(table.shape)}"
            )
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.dtype != torch.int64:
            raise TypeError(f"{name} has dtype {index.dtype}; expected int64")
        if index.shape != (num_tokens,):
            raise ValueError(f"{name} shape {tuple(index.shape)} must be [T] = ({num_tokens},) to match qkv")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together: pass both (Qwen3) or neither")
    if q_norm_weight is not None and eps is None:
        raise ValueError("eps is required with the norm weights (the model's rms_norm_eps)")
    tensors = {"qkv": qkv, "positions": positions, "cos_cache": cos_cache, "sin_cache": sin_cache}
    tensors |= {"k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            if w.shape != (head_dim,):
                raise ValueError(f"{name} shape {tuple(w.shape)} must be [D] = ({head_dim},)")
            if w.dtype != qkv.dtype:
                raise TypeError(f"{name} has dtype {w.dtype}; expected qkv's dtype {qkv.dtype}")
            tensors[name] = w
    for name, t in tensors.items():
        if t.device != qkv.device:
            raise ValueError(f"{name} is on {t.device}, qkv on {qkv.device}: all inputs must share one device")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1); got strides {t.stride()}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (qkv.dtype, KV_FP8_DTYPE):
        raise TypeError(
            f"caches have dtypes {k_cache.dtype}/{v_cache.dtype}; expected qkv's dtype {qkv.dtype} for both, or "
            "float8_e4m3fn for both (an FP8 cache)"
        )
    return num_heads, num_kv_heads, head_dim


def qk_norm_rope_kv(
    qkv: torch.Tensor,  # [T, (H + 2 * Hkv) * D]: the packed projection output, rows may be strided
    positions: torch.Tensor,  # [T] int64, each in [0, P), padding tokens included
    cos_cache: torch.Tensor,  # [P, D/2] float32
    sin_cache: torch.Tensor,  # [P, D/2] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1: padding, not stored
    q_norm_weight: torch.Tensor | None = None,  # [D] (Qwen3) or None: no q/k norm
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float | None = None,  # the norm's epsilon; required with the weights
    q_out: torch.Tensor | None = None,  # [T, H, D]
    unit_offset: bool = False,  # Gemma's q/k norm: scale by (1 + weight) in float32 (gemma_rms_norm_ref)
    k_scale: torch.Tensor | None = None,  # an FP8 cache's scales: float32, one element each, on qkv's device
    v_scale: torch.Tensor | None = None,
    pdl: bool = False,  # a programmatic dependent launch (CUDA, Hopper or newer): see kernels/pdl.py
) -> torch.Tensor:
    """Normed (when weights are given) and rotated queries into `q_out` (allocated when None, the only
    allocation), returned; normed and rotated keys and the raw values stored at slot_mapping. Every token gets
    its q row; tokens with slot -1 store nothing. Grid and constants depend on shapes only (CUDA-graph safe);
    positions and slots are not range-checked (that would need a host sync)."""
    args = (qkv, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps)
    num_heads, num_kv_heads, head_dim = _check(*args)
    kv_fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens = qkv.shape[0]
    if q_out is None:
        q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    elif q_out.shape != (num_tokens, num_heads, head_dim) or q_out.dtype != qkv.dtype or q_out.stride(-1) != 1:
        raise ValueError(
            f"q_out must be [T, H, D] = {(num_tokens, num_heads, head_dim)} in {qkv.dtype} with stride(-1) == 1; "
            f"got {q_out.dtype} {tuple(q_out.shape)} strides {q_out.stride()}"
        )
    elif q_out.device != qkv.device:
        raise ValueError(f"q_out is on {q_out.device}, qkv on {qkv.device}: all inputs must share one device")
    if num_tokens == 0:
        return q_out
    has_norm = q_norm_weight is not None
    block_r = triton.next_power_of_2(num_heads // num_kv_heads + 1)  # the query heads of a group and its key
    block_half = triton.next_power_of_2(head_dim // 2)
    _qk_norm_rope_kv_kernel[(num_tokens, num_kv_heads)](
        qkv, positions, cos_cache, sin_cache, q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,
        k_cache, v_cache, slot_mapping, q_out,
        k_scale if kv_fp8 else qkv, v_scale if kv_fp8 else qkv, eps if has_norm else 0.0,
        qkv.stride(0), cos_cache.stride(0), sin_cache.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        q_out.stride(0), q_out.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_R=block_r, BLOCK_HALF=block_half, HAS_NORM=has_norm,
        UNIT_OFFSET=unit_offset, KV_FP8=kv_fp8, PDL=pdl,
        num_warps=1 if block_r * block_half <= 128 else 2 if block_r * block_half <= 512 else 4,
        enable_fp_fusion=False,  # no fused multiply-add: x1*cos - x2*sin rounds each product, as torch does
        **pdl_launch(pdl),
    )  # fmt: skip
    return q_out
