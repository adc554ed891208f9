"""The paged attention launchers' input contract (kernels/paged_attention.py): shapes, dtypes, devices,
strides, the sliding window and an FP8 cache's scales, checked on the host before any launch, each failure
naming the argument. Imports only torch.
"""

from __future__ import annotations

import torch

from .kv_cache_fp8_ref import KV_FP8_DTYPE, check_kv_scales

__all__ = ["check_inputs", "check_kv_scales", "check_window"]


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, int, int]:
    """Validates the shared inputs; returns (group, head_dim, block_size)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, H, D] and k/v caches [num_blocks, block_size, Hkv, D] of one shape; got q "
            f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads/dim {num_heads}/{head_dim} do not fit the cache's {num_kv_heads}/{k_cache.shape[3]}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two (e.g. 16)")
    if q.dtype != out.dtype or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, KV_FP8_DTYPE):
        raise TypeError(
            f"q and out must share one dtype, and the caches that dtype or float8_e4m3fn (an FP8 cache); got q "
            f"{q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}, out {out.dtype}"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype {q.dtype} is not supported; use float32, float16 or bfloat16")
    if out.shape != q.shape:
        raise ValueError(f"out shape {tuple(out.shape)} must equal q shape {tuple(q.shape)}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1); got strides {t.stride()}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share one device")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32 or t.device != q.device:
            raise TypeError(f"{name} must be int32 on {q.device}; got {t.dtype} on {t.device}")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [B, max_blocks] with unit column stride; got {block_tables.stride()}")
    return num_heads // num_kv_heads, head_dim, block_size


def check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r} must be an int >= 1, or None for global attention")
