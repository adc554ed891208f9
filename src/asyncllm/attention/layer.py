"""The attention op of a decoder layer: hands q/k/v and this layer's paged cache to the backend.

Owns head bookkeeping, the softmax scale, the layer's sliding window and its KV-cache scales (what an FP8 cache
divides keys and values by; a checkpoint may carry them) only. Which kernel runs, and how the cache is laid out,
belong to the `AttentionBackend` given at construction; the per-step batch layout arrives as an argument.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        scale: float | None = None,  # the softmax scale; None: head_dim ** -0.5 (Gemma passes its own)
        window: int | None = None,  # this layer's sliding window (keys within it, the query's own included); None: all
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        if window is not None and window < 1:
            raise ValueError(f"sliding window={window} must be >= 1 (or None: global attention)")
        self.window = window
        self.backend = backend  # stateless and shared by every layer; not a submodule
        # float32 scalars on the device the layer is built on (the loader's), read there by the kernels. Plain
        # attributes, not buffers: `model.to(bfloat16)` must not round them, and no checkpoint has to carry them.
        self.k_scale = torch.ones((), dtype=torch.float32)
        self.v_scale = torch.ones((), dtype=torch.float32)

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """The scales an FP8 cache stores this layer's keys and values with (`kv_cache_dtype="fp8"`; a cache in
        the model's dtype ignores them). Filled in place: a captured CUDA graph reads them where they are."""
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        self.k_scale.fill_(k_scale)
        self.v_scale.fill_(v_scale)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], rotary already applied
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], rotary already applied
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta, self.k_scale, self.v_scale)
        return self.attend_cached(q, kv_cache, meta)

    def attend_cached(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention alone, for callers whose fused kernel already wrote this step's KV into the cache."""
        k_cache, v_cache = kv_cache
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale, self.window, self.k_scale, self.v_scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"window={self.window}, backend={self.backend.name}"
        )
