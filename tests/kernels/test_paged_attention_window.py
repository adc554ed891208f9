"""Sliding-window paged attention: the Triton kernels against `paged_attention_ref(..., window=)`.

Windows of 1 (each query sees itself alone), shorter than a tile, unaligned to blocks and tiles, and longer
than every sequence, over decode, whole prompts and chunks whose keys start before their queries. Before each
kernel runs, every cache slot outside all of its sequence's windows is set to NaN (as if the block manager had
given those blocks away): a kernel that reads one fails loudly.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_kernels import TOLERANCE
from tests.kernels.test_paged_attention import make_batch, run_decode, run_prefill

WINDOWS = [1, 5, 33, 1000]  # itself alone; inside one tile; across tiles and blocks, unaligned; past every sequence


@pytest.fixture(scope="module")
def pa():
    from tests.fixtures.triton_kernels import import_paged_attention

    return import_paged_attention()


def _reference(pa, q, k_cache, v_cache, meta, scale: float, window: int) -> torch.Tensor:
    args = (q, k_cache, v_cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, scale)
    return pa.paged_attention_ref(*args, window=window)


def _poison_outside_windows(k_cache, v_cache, meta, window: int) -> None:
    """NaN into every slot of a sequence that lies before its first query's window."""
    block_size = k_cache.shape[1]
    tables = meta.block_tables.cpu()
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        for pos in range(max(0, seq_len - q_len - window + 1)):
            block, row = int(tables[i, pos // block_size]), pos % block_size
            k_cache[block, row] = float("nan")
            v_cache[block, row] = float("nan")


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), f"{out.isnan().any(-1).any(-1).sum().item()} rows unwritten or read poison"
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.slow
def test_decode_window_matches_ref(pa, window: int, block_size: int) -> None:
    q, k_cache, v_cache, meta = make_batch(
        [(n - 1, 1) for n in (1, 2, 15, 16, 17, 100, 257)], 2, 2, 64, block_size, torch.float32, seed=window
    )
    ref = _reference(pa, q, k_cache, v_cache, meta, 0.125, window)
    _poison_outside_windows(k_cache, v_cache, meta, window)
    for num_splits in (1, 3):  # splits divide the window's keys; some stay empty
        _check(run_decode(pa, q, k_cache, v_cache, meta, 0.125, num_splits, block_n=16, window=window), ref)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
@pytest.mark.slow
def test_prefill_window_matches_ref(pa, window: int, block_m: int, block_n: int) -> None:
    """Whole prompts and chunks after cached keys (contexts not aligned to tiles or blocks, 80 past a window of
    33 and a key tile: the whole tiles before its window are skipped); tiles taller than the key tiles, so a
    row can see no key of a whole tile."""
    seqs = [(0, 2), (0, 40), (13, 2), (16, 15), (1, 16), (80, 17), (57, 40), (3, 7)]
    q, k_cache, v_cache, meta = make_batch(seqs, 2, 2, 64, 4, torch.float32, seed=window + block_m)
    ref = _reference(pa, q, k_cache, v_cache, meta, 0.125, window)
    _poison_outside_windows(k_cache, v_cache, meta, window)
    out = run_prefill(pa, q, k_cache, v_cache, meta, 0.125, block_m=block_m, block_n=block_n, window=window)
    _check(out, ref)


def test_graph_shaped_window_launches(pa) -> None:
    """A fixed grid (decode padding entries, prefill programs striding over a larger tile buffer) with a window."""
    seqs = [(13, 2), (16, 15), (0, 40), (240, 17), (8, 1), (0, 3), (30, 1)]
    q, k_cache, v_cache, meta = make_batch(seqs, 2, 2, 64, 16, torch.float32, seed=5)
    ref = _reference(pa, q, k_cache, v_cache, meta, 0.125, 9)
    _poison_outside_windows(k_cache, v_cache, meta, 9)
    decode = torch.zeros(q.shape[0], dtype=torch.bool)
    decode[[meta.query_start_loc[i].item() for i, n in enumerate(meta.query_lens_cpu) if n == 1]] = True
    prefill = run_prefill(pa, q, k_cache, v_cache, meta, 0.125, block_m=16, capacity=12, num_programs=3, window=9)
    out = run_decode(pa, q, k_cache, v_cache, meta, 0.125, num_splits=2, pad=5, block_n=16, window=9)
    out[~decode] = prefill[~decode]
    _check(out, ref)


def test_reference_window_is_transformers_mask(pa) -> None:
    """The specification's window is transformers' own: `sliding_window_causal_mask_function` over the same
    positions (query j of a chunk after `context` cached keys sits at context + j)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    window, context, q_len = 5, 9, 6
    q, k_cache, v_cache, meta = make_batch([(context, q_len)], 1, 1, 16, 4, torch.float32, seed=0)
    ref = _reference(pa, q, k_cache, v_cache, meta, 1.0, window)
    mask_fn = sliding_window_causal_mask_function(window)
    keys = torch.cat([k_cache[b] for b in meta.block_tables[0].tolist()])[: context + q_len, 0].float()
    values = torch.cat([v_cache[b] for b in meta.block_tables[0].tolist()])[: context + q_len, 0].float()
    for j in range(q_len):
        q_idx, kv_idx = torch.tensor(context + j), torch.arange(context + q_len)
        visible = mask_fn(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)  # [L] bool
        expected = torch.softmax(keys[visible] @ q[j, 0].float(), dim=0) @ values[visible]
        torch.testing.assert_close(ref[j, 0].float(), expected, atol=1e-5, rtol=1e-5)


def test_launcher_rejects_bad_window(pa) -> None:
    batch = make_batch([(3, 1)], 2, 2, 64, 16, torch.float32, seed=1)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="window"):
            run_decode(pa, *batch, 1.0, 1, window=bad)
