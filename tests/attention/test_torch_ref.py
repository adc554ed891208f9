"""The torch reference paged attention against dense causal SDPA over the same keys and values.

Random shuffled block tables, decode/prefill/chunked sequences mixed in one step, odd lengths, GQA groups
1/2/4, float32 and bfloat16, global and sliding-window. Never-written cache memory is NaN, so reading a wrong
slot fails loudly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm.attention.torch_ref import TorchAttentionBackend, store_kv
from tests.fixtures.paged import PagedBatcher

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # max abs error; outputs are O(1)

# (already cached tokens, new tokens) per sequence
MIXED = [(0, 7), (5, 1), (9, 4), (0, 1), (12, 1), (3, 5), (16, 1)]
DECODE_ONLY = [(4, 1), (0, 1), (17, 1), (8, 1)]


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """q [n, H, D] at positions cached.., k/v [L, Hkv, D] -> [n, H, D] via SDPA in float32."""
    n, seq_len = q.shape[0], k.shape[0]
    kpos, qpos = torch.arange(seq_len)[None, :], torch.arange(n)[:, None] + cached
    mask = kpos <= qpos  # [n, L], True = attend
    if window is not None:
        mask &= kpos > qpos - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _run(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    dtype: torch.dtype,
    block_size: int,
    seed: int,
    window: int | None = None,
):
    gen = torch.Generator().manual_seed(seed)
    num_heads, head_dim = num_kv_heads * group, 12
    scale = head_dim**-0.5
    batcher = PagedBatcher(num_blocks=96, block_size=block_size, seed=seed)
    [(k_cache, v_cache)] = batcher.new_caches(1, num_kv_heads, head_dim, dtype)
    keys = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in seqs]
    values = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype) for c, n in seqs]
    queries = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for _, n in seqs]
    prefix = [(i, c) for i, (c, _) in enumerate(seqs) if c > 0]
    if prefix:  # earlier steps' keys/values, as a previous forward would have stored them
        _, meta = batcher.step(prefix)
        store_kv(
            torch.cat([keys[i][:c] for i, c in prefix]),
            torch.cat([values[i][:c] for i, c in prefix]),
            k_cache,
            v_cache,
            meta.slot_mapping,
        )
    _, meta = batcher.step([(i, n) for i, (_, n) in enumerate(seqs)])
    k_new = torch.cat([keys[i][c:] for i, (c, _) in enumerate(seqs)])
    v_new = torch.cat([values[i][c:] for i, (c, _) in enumerate(seqs)])
    if window is not None:  # keys before every window are never read: poison them (as if given away)
        for i, (c, _) in enumerate(seqs):
            for pos in range(max(0, c - window + 1)):
                block = batcher.tables[i][pos // block_size]
                k_cache[block, pos % block_size] = v_cache[block, pos % block_size] = float("nan")
    out = TorchAttentionBackend().forward(torch.cat(queries), k_new, v_new, k_cache, v_cache, meta, scale, window)
    assert out.dtype == dtype and out.shape == (sum(n for _, n in seqs), num_heads, head_dim)
    flat_k = k_cache.flatten(0, 1)
    assert torch.equal(flat_k[meta.slot_mapping], k_new), "new keys must land in their slots"
    expected = torch.cat([_dense(queries[i], keys[i], values[i], c, scale, window) for i, (c, _) in enumerate(seqs)])
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("seqs", [MIXED, DECODE_ONLY, [(0, 13)]], ids=["mixed", "decode", "prefill"])
def test_matches_dense_causal_sdpa(seqs: list[tuple[int, int]], group: int, dtype: torch.dtype) -> None:
    for seed, block_size in enumerate([1, 3, 4, 16]):
        out, expected = _run(seqs, num_kv_heads=2, group=group, dtype=dtype, block_size=block_size, seed=seed)
        torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_decode_ignores_nan_in_unwritten_cache_rows() -> None:
    """Regression: batched decode padded shorter sequences with garbage rows; probability 0 times a NaN
    value (never-written cache memory) made the whole output NaN. Padded value rows are now zeroed."""
    out, expected = _run([(2, 1), (22, 1)], num_kv_heads=1, group=2, dtype=torch.float32, block_size=4, seed=9)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 3, 6, 100])
@pytest.mark.parametrize("seqs", [MIXED, DECODE_ONLY, [(0, 13)]], ids=["mixed", "decode", "prefill"])
def test_sliding_window_matches_dense_sdpa(seqs: list[tuple[int, int]], window: int) -> None:
    """Keys p - window + 1..p for the query at p; the keys before every window hold NaN and are not read."""
    for seed, block_size in enumerate([1, 3, 4]):
        out, expected = _run(seqs, 2, 2, torch.float32, block_size, seed, window=window)
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 50])
def test_long_chunks_attend_in_blocks_of_query_rows(window: int | None) -> None:
    """Chunks whose [H, Q, K] scores exceed the reference's at-once bound (4 heads x 600 keys: under 440 rows a
    block) are attended a block of query rows at a time: each row's softmax is its own, so the result is the
    dense one, with cached keys before the chunk and with a window."""
    seqs = [(0, 600), (300, 400)]
    out, expected = _run(seqs, num_kv_heads=2, group=2, dtype=torch.float32, block_size=16, seed=4, window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
