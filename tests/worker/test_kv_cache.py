"""The CPU KV cache: its default size (one max_model_len sequence within [1/4, 1] GiB, or the explicit budget)
and its allocation (zeros that cost resident memory only once written)."""

from __future__ import annotations

import pytest
import torch

from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache, cpu_kv_blocks

# SmolLM2-135M in float32: 30 layers, 3 KV heads of 64 -> 737,280 bytes per 16-token block
SMOLLM2 = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
LARGE = KVCacheSpec(num_layers=28, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float32)


def test_default_holds_one_full_sequence() -> None:
    assert cpu_kv_blocks(SMOLLM2, None, 8192, 10**9) == 512  # 8,192 tokens: 360 MiB, not the old 1 GiB
    assert cpu_kv_blocks(SMOLLM2, None, 512, 10**9) == 2**28 // SMOLLM2.bytes_per_block  # the 1/4 GiB floor
    assert cpu_kv_blocks(LARGE, None, 40960, 10**9) == 2**30 // LARGE.bytes_per_block  # the 1 GiB ceiling
    assert cpu_kv_blocks(SMOLLM2, None, 8192, 100) == 100  # never more than max_num_seqs could use


def test_explicit_budget_wins() -> None:
    assert cpu_kv_blocks(SMOLLM2, 2.0, 8192, 10**9) == 2 * 2**30 // SMOLLM2.bytes_per_block
    assert cpu_kv_blocks(SMOLLM2, 0.01, 8192, 10**9) == int(0.01 * 2**30) // SMOLLM2.bytes_per_block


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_is_zeros_in_disjoint_aligned_layers(dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    caches = allocate_kv_cache(spec, 5, torch.device("cpu"))
    assert len(caches) == 3
    for k, v in caches:
        for t in (k, v):
            assert t.shape == (5, 4, 2, 8) and t.dtype == dtype and t.is_contiguous()
            assert t.data_ptr() % 64 == 0 and not t.any()
    caches[1][0].fill_(1.0)  # one layer's keys written: nothing else moves
    assert all(not t.any() for i, kv in enumerate(caches) for j, t in enumerate(kv) if (i, j) != (1, 0))


def test_cpu_cache_is_resident_only_once_written() -> None:
    """Regression: torch.zeros wrote every byte of the 1 GiB default at start-up (seconds, and 1 GiB resident
    before any request); then numpy's calloc asked for transparent huge pages, and a first token committed
    2 MiB of each layer's keys and values (118 MiB for SmolLM2)."""
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)
    num_blocks = 2**28 // spec.bytes_per_block  # 256 MiB
    before = _rss_bytes()
    caches = allocate_kv_cache(spec, num_blocks, torch.device("cpu"))
    assert _rss_bytes() - before < 32 * 2**20
    before = _rss_bytes()
    for k, v in caches:  # one block of every layer, as a first token writes
        k[num_blocks // 2].fill_(1.0)
        v[num_blocks // 2].fill_(1.0)
    assert _rss_bytes() - before < 4 * 2**20  # 8 blocks of 16 KiB, in 4 KiB pages; huge pages: 16 MiB
    assert float(caches[0][0][num_blocks // 2].sum()) == 16 * 4 * 64
