"""Decode attention over the paged cache in three ops a layer, for the CPU decode path (models/cpu_decode.py):
one `index_select` per cache gathers the batch's blocks, one `scaled_dot_product_attention` attends. Where every
layer's caches lie in one storage (the CPU engine's) the keys of all layers are taken once a step instead
(`step_keys`: views of a lone sequence's consecutive blocks, else one gather), and a layer only attends.

It takes the steps the torch reference (torch_ref.py, its twin and specification) would batch without any mask:
every sequence decodes one token and all have the same length, so every gathered key is seen by every query
(batch-1 decode, the main job on a CPU). Grouped query heads ride on the query-length axis of the kernel
([B, Hkv, G, D] against [B, Hkv, L, D]), so no key is copied per head and no `enable_gqa` (torch 2.5) is needed.
Knows nothing of models; a cache in the activations' dtype only (an FP8 cache's codes take the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class StepKeys:
    """Every layer's keys then values for a decode step, [B, Hkv, seq_len, D] each (layer i's at 2i and 2i + 1),
    made once a step (`step_keys`). `copied`: they are a gathered copy, so each layer also writes its new token's
    key and value into them (`write`); else they are views of the cache, which see the cache's own writes."""

    kv: list[torch.Tensor]
    copied: bool

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer`'s new keys and values [B, Hkv, D] at each sequence's last position (a copy's only)."""
        if self.copied:
            self.kv[2 * layer][:, :, -1] = k
            self.kv[2 * layer + 1][:, :, -1] = v


def step_keys(stacked: torch.Tensor, blocks: torch.Tensor, batch: int, seq_len: int) -> StepKeys:
    """The step's keys and values from the cache (`stacked_caches`) in a few ops for every layer at once: views
    where a lone sequence's blocks are consecutive ids (fresh blocks are handed out in order, so a first chat
    turn's are), else one gather of every layer's blocks (the step's new tokens not yet in it: `StepKeys.write`)."""
    first, count = int(blocks[0]), len(blocks)
    views = batch == 1 and int(blocks[-1]) - first == count - 1 and bool((blocks.diff() == 1).all())
    rows = stacked[:, first : first + count] if views else stacked.index_select(1, blocks)  # [2L, B * nb, ...]
    rows = rows.reshape(rows.shape[0], batch, -1, *rows.shape[3:])[:, :, :seq_len]  # [2L, B, L, Hkv, D]
    return StepKeys(list(rows.transpose(2, 3).unbind(0)), copied=not views)  # [B, Hkv, L, D], strided


def attend_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_decode_attention` over one layer's `StepKeys`: q [B, H, D] -> [B, H * D]."""
    batch, num_heads, head_dim = q.shape
    qg = q.view(batch, k.shape[1], num_heads // k.shape[1], head_dim)
    return F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(batch, num_heads * head_dim)


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
