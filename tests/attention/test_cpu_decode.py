"""The CPU decode attention (attention/cpu_decode.py) against its twin, the torch reference's batched decode, in
float32 over odd head counts, grouped heads, block sizes and batches of sequences of one length."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.cpu_decode import (
    attend_views,
    decode_blocks,
    paged_decode_attention,
    sequence_views,
    stacked_caches,
)
from asyncllm.attention.torch_ref import TorchAttentionBackend
from tests.fixtures.paged import PagedBatcher


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (6, 1, 8), (8, 2, 32)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("batch", "seq_len"), [(1, 1), (1, 37), (3, 16), (2, 50)])
@pytest.mark.parametrize("adjacent", [False, True])  # True: both caches in one storage, as the CPU engine's
def test_matches_the_reference_decode(heads, kv_heads, dim, block_size, batch, seq_len, adjacent) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dim + block_size + seq_len)
    batcher = PagedBatcher(num_blocks=batch * 64, block_size=block_size, seed=seq_len)
    [(k_cache, v_cache)] = batcher.new_caches(1, kv_heads, dim, torch.float32)
    if adjacent:
        k_cache, v_cache = torch.stack((k_cache, v_cache)).unbind(0)
    backend = TorchAttentionBackend()
    if seq_len > 1:  # the earlier keys, written as a prompt would write them
        _, meta = batcher.step([(s, seq_len - 1) for s in range(batch)])
        rows = meta.slot_mapping.shape[0]
        k, v = torch.randn(2, rows, kv_heads, dim, generator=gen)
        backend.write_kv(k, v, k_cache, v_cache, meta)
    _, meta = batcher.step([(s, 1) for s in range(batch)])
    q = torch.randn(batch, heads, dim, generator=gen)
    k, v = torch.randn(2, batch, kv_heads, dim, generator=gen)
    backend.write_kv(k, v, k_cache, v_cache, meta)
    scale = dim**-0.5
    want = backend.attend(q, k_cache, v_cache, meta, scale)  # [B, H, D]
    blocks = decode_blocks(meta.block_tables, seq_len, block_size)
    got = paged_decode_attention(q, k_cache, v_cache, blocks, seq_len, scale)
    assert got.shape == (batch, heads * dim)
    torch.testing.assert_close(got, want.reshape(batch, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (6, 1, 8)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seq_len", [1, 5, 37])
def test_a_lone_sequence_in_consecutive_blocks_reads_views_of_the_cache(heads, kv_heads, dim, block_size, seq_len):
    """Every layer's keys and values in one storage, as the CPU engine allocates them (worker/kv_cache.py): a lone
    sequence whose blocks are consecutive ids is attended through views made once a step (`sequence_views`),
    which see what a layer writes after they are made, and give the reference's result; blocks out of order,
    or a batch, take the gather (None)."""
    layers, num_blocks, first = 3, 64, 7
    gen = torch.Generator().manual_seed(heads + dim + block_size + seq_len)
    store = torch.randn(2 * layers, num_blocks, block_size, kv_heads, dim, generator=gen)
    caches = [(store[2 * i], store[2 * i + 1]) for i in range(layers)]
    stacked = stacked_caches(caches)
    assert stacked is not None
    nb = -(-seq_len // block_size)
    table = torch.arange(first, first + nb, dtype=torch.int32)[None, :]
    blocks = decode_blocks(table, seq_len, block_size)
    views = sequence_views(stacked, blocks, 1, seq_len)
    assert views is not None and len(views) == 2 * layers
    slot = first * block_size + seq_len - 1  # this step's token, written after the views were made
    scale = dim**-0.5
    for i, (k_cache, v_cache) in enumerate(caches):
        k_cache.view(-1, kv_heads, dim)[slot] = torch.randn(kv_heads, dim, generator=gen)
        v_cache.view(-1, kv_heads, dim)[slot] = torch.randn(kv_heads, dim, generator=gen)
        q = torch.randn(1, heads, dim, generator=gen)
        want = paged_decode_attention(q, k_cache, v_cache, blocks, seq_len, scale)  # the gather
        torch.testing.assert_close(attend_views(q, views[2 * i], views[2 * i + 1], scale), want, rtol=0, atol=0)
    if nb > 1:
        shuffled = blocks.flip(0)
        assert sequence_views(stacked, shuffled, 1, seq_len) is None
    assert sequence_views(stacked, torch.cat((blocks, blocks + nb)), 2, seq_len) is None
    assert stacked_caches([(store[0], store[2]), (store[1], store[3])]) is None  # not in the engine's order
