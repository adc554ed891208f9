"""The specification of the fused q/k norm + rotary + paged KV store (`qk_norm_rope_kv.py`), in pure PyTorch:
the model's own steps (split the packed qkv, per-head RMSNorm of q and k for Qwen3, rotary, store) composed
from the same references the layers call. Imports only torch (and the sibling references).
"""

from __future__ import annotations

import torch

from .kv_cache_fp8_ref import write_kv
from .rms_norm_ref import gemma_rms_norm_ref, rms_norm_ref
from .rotary_ref import apply_rotary_ref


def qk_norm_rope_kv_ref(
    qkv: torch.Tensor,  # [T, (H + 2 * Hkv) * D]
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [P, D/2]
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1: padding, not stored
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float | None = None,
    unit_offset: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `qk_norm_rope_kv`: the model's split, per-head RMSNorm (Qwen3's, or Gemma's with
    `unit_offset`), apply_rotary and store_kv (kv_cache_fp8_ref.write_kv: an FP8 cache quantized with the
    scales). Skipping padding slots needs a boolean index, i.e. a host sync:
    not for graphs."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_tokens, num_heads = qkv.shape[0], qkv.shape[1] // head_dim - 2 * num_kv_heads
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        norm = gemma_rms_norm_ref if unit_offset else rms_norm_ref
        q, k = norm(q, q_norm_weight, eps), norm(k, k_norm_weight, eps)  # over D
    cos, sin = cos_cache[positions], sin_cache[positions]  # [T, D/2] float32
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for cache, new, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        write_kv(cache, slots, new[keep], scale)
    return q
