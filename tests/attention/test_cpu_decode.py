"""The CPU decode attention (attention/cpu_decode.py) against its twin, the torch reference's batched decode, in
float32 over odd head counts, grouped heads, block sizes and batches of sequences of one length."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.cpu_decode import (
    attend_keys,
    decode_blocks,
    paged_decode_attention,
    stacked_caches,
    step_keys,
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
@pytest.mark.parametrize("layout", ["consecutive", "shuffled", "batch"])
def test_every_layers_keys_taken_once_a_step_give_the_gather(heads, kv_heads, dim, block_size, seq_len, layout):
    """Every layer's keys and values in one storage, as the CPU engine allocates them (worker/kv_cache.py): taken
    once a step (`step_keys`) before any layer writes its new token, as views of a lone sequence's consecutive
    blocks or as one gather (blocks out of order, a batch), then each layer's new key and value written, they
    give exactly what each layer's own gather gives."""
    layers, num_blocks = 3, 160
    gen = torch.Generator().manual_seed(heads + dim + block_size + seq_len)
    store = torch.randn(2 * layers, num_blocks, block_size, kv_heads, dim, generator=gen)
    caches = [(store[2 * i], store[2 * i + 1]) for i in range(layers)]
    stacked = stacked_caches(caches)
    assert stacked is not None
    assert stacked_caches([(store[0], store[2]), (store[1], store[3])]) is None  # not in the engine's order
    nb, batch = -(-seq_len // block_size), 3 if layout == "batch" else 1
    shuffled = torch.randperm(num_blocks, generator=gen)[: batch * nb]
    ids = torch.arange(7, 7 + nb) if layout == "consecutive" else shuffled
    table = ids.view(batch, nb).to(torch.int32)
    blocks = decode_blocks(table, seq_len, block_size)
    keys = step_keys(stacked, blocks, batch, seq_len)
    assert keys.copied == ((layout != "consecutive" and nb > 1) or batch > 1)
    slots = table[:, (seq_len - 1) // block_size].long() * block_size + (seq_len - 1) % block_size
    scale = dim**-0.5
    for i, (k_cache, v_cache) in enumerate(caches):
        k_new, v_new = torch.randn(2, batch, kv_heads, dim, generator=gen)
        k_cache.view(-1, kv_heads, dim).index_copy_(0, slots, k_new)  # the step's tokens, after the keys were taken
        v_cache.view(-1, kv_heads, dim).index_copy_(0, slots, v_new)
        keys.write(i, k_new, v_new)
        q = torch.randn(batch, heads, dim, generator=gen)
        want = paged_decode_attention(q, k_cache, v_cache, blocks, seq_len, scale)  # this layer's own gather
        torch.testing.assert_close(attend_keys(q, keys.kv[2 * i], keys.kv[2 * i + 1], scale), want, rtol=0, atol=0)
