"""The folded decode reduce (`paged_decode_attention(..., counters=...)`: the split kernel's last program
merges) against its twin, the separate reduce kernel, and `paged_attention_ref`.

Lengths give every live split count from 1 to the grid's (short sequences in a many-split grid), batches up to
64, the GQA ratios of the supported models (1, 2, 4, 7, 8), and each launch twice with other lengths: the
counters must be back at 0 after a call, or the second call's tickets would never reach the last one. The
interpreter runs programs one after another, so it checks the merge, not memory ordering: the GPU tests do
that, with many splits and rows at once, in every dtype and replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_paged_attention
from tests.kernels.test_paged_attention import check, make_batch, run_decode

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pa():
    return import_paged_attention()


def counters_for(batch, group_rows: int = 0) -> torch.Tensor:
    """Zeroed tickets for the batch's decode entries (plus `group_rows` spare entries) x KV heads."""
    q, k_cache, _, meta = batch
    rows = sum(1 for n in meta.query_lens_cpu if n == 1) + group_rows
    return torch.zeros(rows * k_cache.shape[2], dtype=torch.int32, device=q.device)


def fold_and_twin(pa, batch, scale: float, num_splits: int, counters: torch.Tensor, **config):
    """The folded launch's output, after checking the counters are back at 0, and the separate reduce's."""
    folded = run_decode(pa, *batch, scale, num_splits, counters=counters, **config)
    assert not counters.any(), f"counters left at {counters.tolist()}: the next launch would never merge"
    return folded, run_decode(pa, *batch, scale, num_splits, **config)


def every_live_count(max_splits: int, block_n: int, seed: int) -> list[int]:
    """Lengths whose live splits are 1..max_splits when `max_splits` splits of block_n keys cover them (each
    split takes one tile: tokens_per_split = block_n up to max_splits * block_n keys), shuffled."""
    gen = torch.Generator().manual_seed(seed)
    lens = [block_n * k - int(torch.randint(0, block_n, (1,), generator=gen)) for k in range(1, max_splits + 1)]
    return [lens[i] for i in torch.randperm(len(lens), generator=gen).tolist()]


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
@pytest.mark.slow
def test_fold_equals_reduce_equals_ref_every_live_count(pa, group: int) -> None:
    num_splits, block_n = 6, 16
    counters = None
    for call, seed in enumerate((group, group + 100)):  # twice, other lengths: the counters start clean again
        lens = every_live_count(num_splits, block_n, seed)
        batch = make_batch([(n - 1, 1) for n in lens], 1, group, 32, 16, torch.float32, seed=seed)
        counters = counters_for(batch) if counters is None else counters
        folded, twin = fold_and_twin(pa, batch, 0.125, num_splits, counters, block_n=block_n)
        check(pa, folded, *batch, 0.125)
        torch.testing.assert_close(folded, twin, atol=1e-6, rtol=1e-6, msg=lambda m, call=call: f"call {call}: {m}")


@pytest.mark.slow
def test_fold_most_splits(pa) -> None:
    """MAX_SPLITS splits: live counts 1, 2, half, all but one, all; then batch 1 of the longest."""
    splits = pa.MAX_SPLITS
    lens = [9, 17, 16 * (splits // 2), 16 * splits - 20, 16 * splits]  # 16 keys a split
    batch = make_batch([(n - 1, 1) for n in lens], 1, 2, 32, 16, torch.float32, seed=11)
    counters = counters_for(batch)
    folded, twin = fold_and_twin(pa, batch, 0.125, splits, counters, block_n=16)
    check(pa, folded, *batch, 0.125)
    torch.testing.assert_close(folded, twin, atol=1e-6, rtol=1e-6)
    batch = make_batch([(lens[-1] - 1, 1)], 1, 2, 32, 16, torch.float32, seed=12)
    check(pa, run_decode(pa, *batch, 0.125, splits, counters=counters, block_n=16), *batch, 0.125)
    assert not counters.any(), f"counters left at {counters.tolist()}"


@pytest.mark.parametrize("batch_size", [5, 64])
@pytest.mark.slow
def test_fold_batch_sizes_and_graph_padding(pa, batch_size: int) -> None:
    """Batches up to 64, with -1 entries (a graph's fixed grid) after the real ones and counters sized for the
    padded grid; some sequences one split long, some two."""
    gen = torch.Generator().manual_seed(batch_size)
    lens = torch.randint(1, 33, (batch_size,), generator=gen).tolist()
    batch = make_batch([(n - 1, 1) for n in lens], 1, 2, 32, 16, torch.float32, seed=batch_size)
    counters = counters_for(batch, group_rows=3)
    folded, twin = fold_and_twin(pa, batch, 0.2, 2, counters, pad=3, block_n=16)
    check(pa, folded, *batch, 0.2)
    torch.testing.assert_close(folded, twin, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_fold_sliding_window(pa) -> None:
    """A window's keys split as the window's (live counts from the window's length, not the sequence's)."""
    lens = [1, 20, 64, 65, 130, 300]
    batch = make_batch([(n - 1, 1) for n in lens], 2, 2, 64, 16, torch.float32, seed=9)
    counters = counters_for(batch)
    folded, twin = fold_and_twin(pa, batch, 0.125, 5, counters, block_n=16, window=70)
    torch.testing.assert_close(folded, twin, atol=1e-6, rtol=1e-6)


def test_counters_rejected_when_wrong(pa) -> None:
    batch = make_batch([(40, 1), (7, 1)], 2, 2, 64, 16, torch.float32, seed=1)
    good = counters_for(batch)
    with pytest.raises(ValueError, match="decode entries x KV heads = 4"):
        run_decode(pa, *batch, 0.125, 3, counters=good[:3])
    with pytest.raises(TypeError, match="counters must be a contiguous 1-D int32"):
        run_decode(pa, *batch, 0.125, 3, counters=good.long())


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("group", [2, 7])
def test_gpu_fold_many_splits_many_rows(pa, dtype: torch.dtype, group: int) -> None:
    """Every (row, KV head) of 96 sequences races 32 splits' programs for its ticket (an ordering bug shows as
    a merge that missed a partial): the fold against the reduce twin and the reference, twice."""
    gen = torch.Generator().manual_seed(group)
    counters = None
    for call in range(2):
        lens = [*every_live_count(32, 64, call), *torch.randint(1, 4000, (64,), generator=gen).tolist()]
        batch = make_batch([(n - 1, 1) for n in lens], 8, group, 128, 16, dtype, seed=call + group)
        counters = counters_for(batch) if counters is None else counters
        scale = 128**-0.5
        for num_splits in (32, 7):
            folded, twin = fold_and_twin(pa, batch, scale, num_splits, counters)
            check(pa, folded, *batch, scale)
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(folded.float(), twin.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
def test_gpu_fold_replays_from_a_graph(pa) -> None:
    """Captured once, replayed with other lengths (written into the same seq_lens): each replay's output is the
    eager twin's, so the counters are clean after every replay."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 2000, (16,), generator=gen).tolist()
    q, k_cache, v_cache, meta = batch = make_batch([(n - 1, 1) for n in lens], 8, 2, 128, 16, torch.bfloat16, seed=0)
    seqs = torch.arange(16, dtype=torch.int32, device=DEVICE)
    counters = counters_for(batch)
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, seqs, out, 0.09)
    pa.paged_decode_attention(*args, num_splits=16, counters=counters)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode_attention(*args, num_splits=16, counters=counters)
    for step in range(5):
        shorter = [max(1, n - int(torch.randint(0, n, (1,), generator=gen))) for n in lens]
        meta.seq_lens.copy_(torch.tensor(shorter, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        twin = torch.full_like(q, float("nan"))
        pa.paged_decode_attention(*args[:7], twin, 0.09, num_splits=16)
        torch.testing.assert_close(
            out.float(), twin.float(), atol=2e-2, rtol=2e-2, msg=lambda m, step=step: f"replay {step}: {m}"
        )
    torch.cuda.synchronize()
    assert not counters.any()
