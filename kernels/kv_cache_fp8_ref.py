"""The FP8 KV cache (`kv_cache_dtype="fp8"`), in pure PyTorch: what a stored key or value is.

Codes are e4m3 (float8_e4m3fn, one byte) with one float32 scale per layer for keys and one for values. A write
stores x / scale rounded to the nearest code (ties to even), saturated to +-448 (e4m3fn's largest finite value:
it has no infinity, and past it a cast gives NaN); a read is code * scale in float32. The Triton kernels that
write the cache (qk_norm_rope_kv) and read it (paged_attention) are held to these. Imports only torch.
"""

from __future__ import annotations

import torch

KV_FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == KV_FP8_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x (any float dtype) -> e4m3 codes of x / scale: the same shape, one byte each."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8_DTYPE)


def read_kv(rows: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """Cache rows as float32 numbers: an FP8 cache's codes times its scale; any other cache's values as stored
    (`scale` unused)."""
    if not is_fp8(rows):
        return rows.float()
    if scale is None:
        raise ValueError("an FP8 KV cache is read with its scale (k_scale / v_scale): got None")
    return rows.float() * scale


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] along the first dim, an FP8 cache's through its bytes (torch's indexing kernels may have no
    float8 form on a device)."""
    if not is_fp8(cache):
        return cache[index]
    return cache.view(torch.uint8)[index].view(cache.dtype)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | float | None) -> None:
    """x [N, Hkv, D] into rows `slots` [N] of `cache` [num_blocks, block_size, Hkv, D] (slot = block *
    block_size + row): quantized with `scale` in an FP8 cache, cast to the cache's dtype in any other."""
    flat = cache.view(-1, *cache.shape[2:])
    if not is_fp8(cache):
        flat.index_copy_(0, slots, x.to(cache.dtype))
        return
    if scale is None:
        raise ValueError("an FP8 KV cache is written with its scale (k_scale / v_scale): got None")
    # index_copy_ has no float8 kernel (CPU or CUDA): the codes go in as bytes.
    flat.view(torch.uint8).index_copy_(0, slots, quantize_kv(x, scale).view(torch.uint8))


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """A kernel launcher's check: whether `k_cache` is an FP8 cache, whose scales must then be float32 tensors
    of one element on its device (read there by the kernels, so a CUDA graph replays whatever they hold)."""
    if not is_fp8(k_cache):
        return False
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise TypeError(f"an FP8 KV cache needs its {name}: a float32 tensor of one element")
        if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != k_cache.device:
            raise TypeError(
                f"{name} must be a float32 tensor of one element on {k_cache.device}; got {scale.dtype} "
                f"{tuple(scale.shape)} on {scale.device}"
            )
    return True
