"""Decode attention over the paged cache in three ops a layer, for the CPU decode path (models/cpu_decode.py):
one `index_select` per cache gathers the batch's blocks, one `scaled_dot_product_attention` attends; a lone
sequence in consecutive blocks (a chat's) is attended through views of the cache made once a step.

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


def stacked_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """[2 * layers, num_blocks, block_size, Hkv, D]: one view of every layer's keys and values where they lie in
    one storage in that order (the CPU engine allocates them so: worker/kv_cache.py), else None."""
    k0 = kv_caches[0][0]
    per, base, storage = k0.numel(), k0.storage_offset(), k0.untyped_storage().data_ptr()
    for i, (k, v) in enumerate(kv_caches):
        for j, cache in enumerate((k, v)):
            if cache.storage_offset() != base + (2 * i + j) * per or not cache.is_contiguous():
                return None
            if cache.untyped_storage().data_ptr() != storage or cache.dtype != k0.dtype or cache.shape != k0.shape:
                return None
    return k0.as_strided((2 * len(kv_caches), *k0.shape), (per, *k0.stride()))


def sequence_views(stacked: torch.Tensor, blocks: torch.Tensor, batch: int, seq_len: int) -> list[torch.Tensor] | None:
    """Every layer's keys then values, [1, Hkv, seq_len, D] each (layer i's at 2i and 2i + 1): views of the
    cache (`stacked_caches`), for a lone sequence whose blocks are consecutive ids (fresh blocks are handed out in
    order, so a lone chat's mostly are): no gather, and what a layer writes into its cache this step is in its
    view. Made once a step, in a few ops; None where they do not apply."""
    if batch != 1 or not len(blocks):
        return None
    first, count = int(blocks[0]), len(blocks)
    if int(blocks[-1]) - first != count - 1 or not bool((blocks.diff() == 1).all()):
        return None
    rows = stacked[:, first : first + count].flatten(1, 2)[:, :seq_len]  # [2 layers, L, Hkv, D]
    return list(rows.transpose(1, 2).unsqueeze(1).unbind(0))  # [1, Hkv, L, D] each, strided: the kernel takes it


def attend_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_decode_attention` over one sequence's `sequence_views`: q [1, H, D] -> [1, H * D]."""
    _, num_heads, head_dim = q.shape
    qg = q.view(1, k.shape[1], num_heads // k.shape[1], head_dim)
    return F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(1, num_heads * head_dim)


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
