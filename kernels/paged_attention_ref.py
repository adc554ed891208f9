"""The specification of the paged attention kernels (kernels/paged_attention.py), in pure PyTorch: what
each query row must equal, whatever the kernels' tiling, splits or launch shapes. Kept apart from the
kernels so it imports no Triton.
"""

from __future__ import annotations

import torch

from .kv_cache_fp8_ref import gather, read_kv


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D], sequences packed by query_lens
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    window: int | None = None,
    k_scale: torch.Tensor | float | None = None,  # an FP8 cache's scales (kv_cache_fp8_ref); else unused
    v_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:  # [T, H, D]
    """The specification of both kernels: query j of a sequence with query_len Q and seq_len L sits at
    position p = L - Q + j and attends keys 0..p of its own blocks, or with a sliding `window` keys
    p - window + 1..p (transformers' `kv_idx > q_idx - window`); softmax in float32 over the cache's keys and
    values as float32 numbers (an FP8 cache's codes times their scales)."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    row = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        k = read_kv(gather(k_cache, blocks).flatten(0, 1)[:seq_len], k_scale).repeat_interleave(group, dim=1)
        v = read_kv(gather(v_cache, blocks).flatten(0, 1)[:seq_len], v_scale).repeat_interleave(group, dim=1)
        qs = q[row : row + q_len].float()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        kpos, qpos = torch.arange(seq_len)[None, :], torch.arange(q_len)[:, None] + (seq_len - q_len)
        visible = kpos <= qpos  # [Q, L]
        if window is not None:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
        out[row : row + q_len] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
        row += q_len
    return out
