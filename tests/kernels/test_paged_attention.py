"""The paged Triton attention kernels against `paged_attention_ref`, their specification.

Odd sequence lengths (1, 2, 15, 16, 17, 100, 257) over shuffled blocks, block sizes 16/32 (and 1/4: the
kernels read the table token by token), GQA groups 1/2/8, head_dim 64/128 (and 24: padded head dims).
The output is filled with NaN before each run and never-written cache slots hold NaN, so an unwritten
row or a read past a sequence fails loudly. CPU runs use float32 in Triton's interpreter; 16-bit on GPU.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.torch_ref import store_kv
from tests.fixtures.paged import PagedBatcher
from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_paged_attention

LENGTHS = [1, 2, 15, 16, 17, 100, 257]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pa():
    return import_paged_attention()


def make_batch(
    seqs: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int, block_size: int, dtype, seed,
    kv_dtype=None, k_scale=None, v_scale=None,
):  # fmt: skip
    """(cached, new) per sequence -> q [T, H, D], caches holding every token's k/v, metadata on DEVICE.
    `kv_dtype` (None: `dtype`): the caches' (float8_e4m3fn: an FP8 cache, written with the scales)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(c + n for c, n in seqs)
    batcher = PagedBatcher(num_blocks=total // block_size + 2 * len(seqs) + 2, block_size=block_size, seed=seed)
    [(k_cache, v_cache)] = batcher.new_caches(1, num_kv_heads, head_dim, kv_dtype or dtype)
    prefix = [(i, c) for i, (c, _) in enumerate(seqs) if c > 0]
    slots = [batcher.step(prefix)[1].slot_mapping] if prefix else []
    _, meta = batcher.step([(i, n) for i, (_, n) in enumerate(seqs)])
    slots = torch.cat([*slots, meta.slot_mapping])
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    on_host = [s.cpu() if isinstance(s, torch.Tensor) else s for s in (k_scale, v_scale)]  # the caches are built here
    store_kv(k, v, k_cache, v_cache, slots, *on_host)
    q = torch.randn(sum(n for _, n in seqs), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta


def run_decode(pa, q, k_cache, v_cache, meta, scale: float, num_splits: int, pad: int = 0, **config) -> torch.Tensor:
    """`pad` entries of -1 (no sequence) are appended to the work list, as a CUDA graph's fixed grid has."""
    decode = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1] + [-1] * pad
    out = torch.full_like(q, float("nan"))
    seqs = torch.tensor(decode, dtype=torch.int32, device=q.device)
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, seqs, out, scale)
    pa.paged_decode_attention(*args, num_splits=num_splits, **config)
    return out


def run_prefill(
    pa, q, k_cache, v_cache, meta, scale: float, block_m: int, capacity: int | None = None, **config
) -> torch.Tensor:
    """`capacity` (with `num_programs` in config): a buffer with room for more tiles than the step has and a
    grid of its own size, as a CUDA graph's."""
    out = torch.full_like(q, float("nan"))
    plan = pa.plan_prefill_tiles(meta.query_lens_cpu, meta.seq_lens_cpu, block_m)
    tiles = torch.tensor(pa.tile_buffer(plan, capacity), dtype=torch.int32)
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles.to(q.device), out)
    pa.paged_prefill_attention(*args, scale, block_m=block_m, **config)
    return out


def check(pa, out: torch.Tensor, q, k_cache, v_cache, meta, scale: float, **kv_scales) -> None:
    assert not out.isnan().any(), f"{out.isnan().any(-1).any(-1).sum().item()} rows were not written"
    args = (q, k_cache, v_cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, scale)
    ref = pa.paged_attention_ref(*args, **kv_scales)
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# Each head layout once, each block size under two of them: the block size decides how a key tile walks the
# table (32: one block per tile of 32 keys; 16: two), the layout how query rows and head dims are loaded; the
# two are independent in the kernels (the GPU test takes every pair, at every dtype).
SHAPES = [(2, 1, 64, 32), (2, 2, 128, 16), (1, 8, 64, 16), (2, 2, 24, 32)]  # kv heads, group, head_dim, block


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", SHAPES)
@pytest.mark.slow
def test_decode_matches_ref(pa, num_kv_heads: int, group: int, head_dim: int, block_size: int) -> None:
    seqs = [(n - 1, 1) for n in LENGTHS]
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, torch.float32, seed=block_size + group)
    scale = head_dim**-0.5
    for num_splits in (1, 3):  # 3 splits of 96 keys: empty splits for the short sequences, partial last ones
        out = run_decode(pa, *batch, scale, num_splits, block_n=32)
        check(pa, out, *batch, scale)


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", SHAPES)
@pytest.mark.slow
def test_prefill_matches_ref(pa, num_kv_heads: int, group: int, head_dim: int, block_size: int) -> None:
    seqs = [(0, n) for n in LENGTHS if n > 1]
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, torch.float32, seed=7 + block_size + group)
    scale = head_dim**-0.5
    check(pa, run_prefill(pa, *batch, scale, block_m=32, block_n=32), *batch, scale)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.slow
def test_chunked_prefill_with_offsets_matches_ref(pa, block_size: int) -> None:
    """Chunks whose keys start before their queries (context = seq_len - query_len), not aligned to tiles:
    contexts shorter than a tile, of one, of several whole tiles (48) and of several tiles and a part (45),
    chunks of a tile or less, a tile and a row (17), several tiles and a part (40). Block size 4 is below the
    tile (the table read per token, as for 1: test_decode_small_blocks takes both)."""
    seqs = [(13, 2), (16, 15), (1, 16), (48, 17), (45, 40), (3, 7)]
    batch = make_batch(seqs, 2, 2, 64, block_size, torch.float32, seed=block_size)
    check(pa, run_prefill(pa, *batch, 0.125, block_m=16, block_n=16), *batch, 0.125)


@pytest.mark.slow
def test_graph_shaped_launches_match_ref(pa) -> None:
    """A fixed grid larger or smaller than the work: decode entries of -1 exit, prefill programs stride over
    the live tile count (fewer programs than tiles, and more), and nothing else is written."""
    seqs = [(13, 2), (16, 15), (0, 40), (48, 17), (8, 1), (0, 3), (30, 1)]
    q, k_cache, v_cache, meta = batch = make_batch(seqs, 2, 2, 64, 16, torch.float32, seed=5)
    decode_rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
    starts = meta.query_start_loc.tolist()
    prefill = torch.ones(q.shape[0], dtype=torch.bool)
    prefill[[starts[i] for i in decode_rows]] = False
    ref = pa.paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, 0.125)
    for programs in (1, 3, 40):  # 8 tiles of 16 rows
        out = run_prefill(pa, *batch, 0.125, block_m=16, block_n=16, capacity=12, num_programs=programs)
        assert out[~prefill.to(out.device)].isnan().all(), "decode rows are the decode kernel's"
        torch.testing.assert_close(out[prefill.to(out.device)], ref[prefill.to(ref.device)], atol=1e-4, rtol=1e-4)
    for num_splits in (1, 2):  # one split writes the output itself; more go through the reduce
        out = run_decode(pa, *batch, 0.125, num_splits=num_splits, pad=5, block_n=16)
        assert out[prefill.to(out.device)].isnan().all(), "prefill rows are the prefill kernel's"
        torch.testing.assert_close(out[~prefill.to(out.device)], ref[~prefill.to(ref.device)], atol=1e-4, rtol=1e-4)


def test_decode_small_blocks_and_many_splits(pa) -> None:
    """Block sizes below a tile (the table is read per token) and more splits than some sequences' tiles."""
    for block_size in (1, 4):
        batch = make_batch([(n - 1, 1) for n in (1, 5, 33, 70)], 1, 2, 64, block_size, torch.float32, seed=3)
        check(pa, run_decode(pa, *batch, 0.125, num_splits=5, block_n=16), *batch, 0.125)


def test_planning() -> None:
    pa = import_paged_attention()
    tiles = pa.plan_prefill_tiles([1, 40, 3, 1], [9, 40, 103, 2], block_m=16)
    assert sorted(tiles) == [(1, 0), (1, 16), (1, 32), (2, 0)]
    assert tiles[0] == (2, 0), "the tile seeing the most keys (103) goes first"
    assert pa.choose_num_splits(1024, 256, 8, 132) == 1  # 2048 programs already fill an H200
    assert pa.choose_num_splits(1024, 1, 8, 132) == 8  # batch 1: split, but >= 128 keys per split
    assert pa.choose_num_splits(1, 1, 1, 132) == 1
    assert pa.tile_buffer([(2, 0), (1, 16)], capacity=3) == [2, 0, 0, 0, 2, 0, 1, 16, 0, 0]
    with pytest.raises(ValueError, match="3 prefill tiles"):
        pa.tile_buffer([(0, 0)] * 3, capacity=2)


def test_max_prefill_tiles_bounds_every_step() -> None:
    """The graph's tile buffer bound holds for any split of a step's rows into decodes and prompt chunks."""
    import random

    pa = import_paged_attention()
    rng = random.Random(0)
    for _ in range(2000):
        num_tokens, max_seqs, block_m = rng.randint(2, 600), rng.randint(1, 64), rng.choice([16, 64, 128])
        lens, left = [], num_tokens
        while left and len(lens) < max_seqs:
            lens.append(rng.randint(1, left))
            left -= lens[-1]
        tiles = pa.plan_prefill_tiles(lens, lens, block_m)
        assert len(tiles) <= pa.max_prefill_tiles(num_tokens, max_seqs, block_m), (lens, block_m)


def test_launcher_rejects_bad_inputs(pa) -> None:
    q, k_cache, v_cache, meta = make_batch([(3, 1)], 2, 2, 64, 16, torch.float32, seed=1)
    seqs = torch.zeros(1, dtype=torch.int32, device=q.device)
    tail = (meta.seq_lens, meta.query_start_loc, seqs)

    def decode(q, k_cache=k_cache, v_cache=v_cache, tables=meta.block_tables, out=None) -> None:
        out = torch.empty_like(q) if out is None else out
        pa.paged_decode_attention(q, k_cache, v_cache, tables, *tail, out, 1.0, num_splits=1)

    with pytest.raises(ValueError, match="heads"):
        decode(q[:, :3])  # 3 query heads over 2 KV heads
    with pytest.raises(TypeError, match="dtype"):
        decode(q.double(), k_cache.double(), v_cache.double())
    with pytest.raises(TypeError, match="block_tables must be int32"):
        decode(q, tables=meta.block_tables.long())
    with pytest.raises(ValueError, match="block_size=12"):
        decode(q, k_cache[:, :12], v_cache[:, :12])
    with pytest.raises(ValueError, match="stride"):
        decode(q, out=torch.empty(q.shape[::-1], device=q.device).transpose(0, 2))


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 128), (8, 128)])
def test_gpu_kernels_match_ref(pa, dtype: torch.dtype, block_size: int, group: int, head_dim: int) -> None:
    """Default launch configurations (the ones the backend uses) at realistic sizes, every dtype."""
    gen = torch.Generator().manual_seed(block_size + group)
    lens = [*LENGTHS, *torch.randint(1, 1500, (40,), generator=gen).tolist()]
    scale = head_dim**-0.5
    batch = make_batch([(n - 1, 1) for n in lens], 4, group, head_dim, block_size, dtype, seed=group)
    for num_splits in (1, pa.choose_num_splits(max(lens), len(lens), 4, 132), 7):
        check(pa, run_decode(pa, *batch, scale, num_splits), *batch, scale)
    chunks = [(0, n) for n in LENGTHS[1:]] + [(c, n) for c, n in ((100, 300), (1000, 129), (5, 700))]
    batch = make_batch(chunks, 4, group, head_dim, block_size, dtype, seed=group + 1)
    block_m = pa.prefill_block_m(dtype, DEVICE)  # what the backend plans with
    check(pa, run_prefill(pa, *batch, scale, block_m=block_m), *batch, scale)
