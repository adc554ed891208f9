"""The CPU decode attention (attention/cpu_decode.py) against its twin, the torch reference's batched decode, in
float32 over odd head counts, grouped heads, block sizes and batches of sequences of one length."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.cpu_decode import decode_blocks, paged_decode_attention
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
