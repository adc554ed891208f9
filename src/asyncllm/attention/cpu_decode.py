"""Decode attention over the paged cache in three ops a layer, for the CPU decode path (models/cpu_decode.py):
one `index_select` per cache gathers the batch's blocks, one `scaled_dot_product_attention` attends.

It takes the steps the torch reference (torch_ref.py, its twin and specification) would batch without any mask:
every sequence decodes one token and all have the same length, so every gathered key is seen by every query
(batch-1 decode, the main job on a CPU). Grouped query heads ride on the query-length axis of the kernel
([B, Hkv, G, D] against [B, Hkv, L, D]), so no key is copied per head and no `enable_gqa` (torch 2.5) is needed.
Knows nothing of models; a cache in the activations' dtype only (an FP8 cache's codes take the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_blocks(block_tables: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[B * nb] int64: the blocks holding each sequence's `seq_len` keys, row after row (made once a step)."""
    num_blocks = -(-seq_len // block_size)
    return block_tables[:, :num_blocks].reshape(-1).long()


def _adjacent(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """[2, num_blocks, block_size, Hkv, D]: one view of both caches where the values directly follow the keys in
    one storage (the CPU engine allocates every layer's pair so: worker/kv_cache.py), else None."""
    size = k_cache.numel() * k_cache.element_size()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.data_ptr() - k_cache.data_ptr() != size:
        return None
    if k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr():
        return None
    return k_cache.as_strided((2, *k_cache.shape), (k_cache.numel(), *k_cache.stride()))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query row per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], this step's keys written
    v_cache: torch.Tensor,
    blocks: torch.Tensor,  # [B * nb] int64 (`decode_blocks`)
    seq_len: int,  # every sequence's key count, this step's included
    scale: float,
) -> torch.Tensor:  # [B, H * D]
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    pair = _adjacent(k_cache, v_cache)
    if pair is not None:  # both caches' blocks in one gather: [2, B * nb, block_size, Hkv, D]
        k, v = pair.index_select(1, blocks).view(2, batch, -1, num_kv_heads, head_dim)[:, :, :seq_len].unbind(0)
    else:  # [B, nb * block_size, Hkv, D] each
        k = k_cache.index_select(0, blocks).view(batch, -1, num_kv_heads, head_dim)[:, :seq_len]
        v = v_cache.index_select(0, blocks).view(batch, -1, num_kv_heads, head_dim)[:, :seq_len]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D], strided: the kernel takes it
    qg = q.view(batch, num_kv_heads, group, head_dim)  # head h = kv head h // G, as the reference groups them
    out = F.scaled_dot_product_attention(qg, k, v, scale=scale)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads * head_dim)
