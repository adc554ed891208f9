"""Cascade decode attention (kernels/paged_attention_cascade.py, kernels/cascade_plan.py) against the plain
decode kernel and `paged_attention_ref`: random groupings over shared physical blocks (group sizes 2 to 40,
prefixes of 1 to 9 blocks, suffixes of 1 key to several blocks with partial last blocks), GQA groups 1/2/8,
sequences in no group mixed in, members whose tables diverge inside the prefix, split counts beside the
prefix's. Never-written cache slots hold NaN. CPU runs use float32 in Triton's interpreter; bf16 on GPU.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncllm.kernels.cascade_plan import (
    cascade_work,
    find_shared_prefixes,
    unit_capacity,
    unit_members,
)
from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_paged_attention

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pa():
    return import_paged_attention()


def shared_batch(groups: list[tuple[int, list[int]]], singles: list[int], block_size: int, seed: int):
    """Block tables and lengths: each group (prefix blocks, suffix keys per member) shares its prefix's
    physical blocks; each single (keys) owns its blocks. Rows in shuffled order. Returns (tables [B, W] int32
    numpy, seq_lens [B] numpy, the prefix blocks each row was given)."""
    rng = random.Random(seed)
    free = list(range(1, 4096))
    rng.shuffle(free)
    rows: list[tuple[list[int], int, int]] = []
    for prefix_blocks, suffixes in groups:
        shared = [free.pop() for _ in range(prefix_blocks)]
        for keys in suffixes:
            own = [free.pop() for _ in range(-(-keys // block_size))]
            rows.append((shared + own, prefix_blocks * block_size + keys, prefix_blocks))
    for keys in singles:
        rows.append(([free.pop() for _ in range(-(-keys // block_size))], keys, 0))
    rng.shuffle(rows)
    width = max(len(t) for t, _, _ in rows)
    tables = np.zeros((len(rows), width), dtype=np.int32)
    for i, (t, _, _) in enumerate(rows):
        tables[i, : len(t)] = t
    return tables, np.array([n for _, n, _ in rows]), [p for _, _, p in rows]


def caches(tables, seq_lens, block_size: int, num_kv_heads: int, head_dim: int, dtype, seed: int):
    """Random keys/values in every slot a sequence holds, NaN everywhere else."""
    gen = torch.Generator().manual_seed(seed)
    shape = (int(tables.max()) + 1, block_size, num_kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in "kv")
    written = torch.zeros(shape[:2], dtype=torch.bool)
    for row, n in zip(tables, seq_lens):
        for pos in range(n):
            written[row[pos // block_size], pos % block_size] = True
    k[~written], v[~written] = float("nan"), float("nan")
    return k.to(DEVICE), v.to(DEVICE)


def run(pa, q, k, v, tables, seq_lens, scale, num_splits, prefix_splits=None, min_prefix_tokens=16, **kv):
    """The decode kernel over every row: plain (`prefix_splits` None) or cascade, the plan's work lists as the
    Triton backend stages them; `kv`: an FP8 cache's scales. Returns (out, the units found)."""
    n, group = len(seq_lens), q.shape[1] // k.shape[2]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    bt = torch.tensor(tables, **i32)
    lens = torch.tensor(seq_lens, **i32)
    qsl = torch.arange(n + 1, **i32)
    out = torch.full_like(q, float("nan"))
    if prefix_splits is None:
        order = torch.tensor(np.argsort(-seq_lens, kind="stable"), **i32)
        pa.paged_decode_attention(q, k, v, bt, lens, qsl, order, out, scale, num_splits=num_splits, **kv)
        return out, None
    members = unit_members(group)
    shared = find_shared_prefixes(tables, seq_lens, k.shape[1], members, min_prefix_tokens)
    order, skip, units, member_list = cascade_work(shared, seq_lens, unit_capacity(n, members))
    lists = (torch.tensor(x.reshape(-1), **i32) for x in (skip, units, member_list))
    cascade = pa.Cascade(*lists, prefix_splits, members)
    order_t = torch.tensor(order, **i32)  # the decode work list, most keys after the prefix first
    pa.paged_decode_attention(q, k, v, bt, lens, qsl, order_t, out, scale, num_splits=num_splits, cascade=cascade, **kv)
    return out, shared


CASES = [  # (groups: (prefix blocks, member suffix keys)), singles, block size, GQA group, splits, prefix splits
    ([(2, [1, 5]), (3, [16, 17, 9])], [7, 40], 8, 2, 1, 3),
    ([(4, [3] * 9 + [20])], [], 4, 1, 3, 2),  # one unit of 10 members
    ([(2, [1, 2, 3] * 8)], [33], 8, 8, 1, 1),  # 24 members, group 8: balanced units of at most 8
    ([(9, [1, 31, 64]), (1, [2, 2])], [3, 100, 1], 4, 2, 3, 2),  # a one-block prefix under the minimum: plain
]


@pytest.mark.parametrize("groups, singles, block_size, group, num_splits, prefix_splits", CASES)
@pytest.mark.slow
def test_cascade_equals_plain_decode(pa, groups, singles, block_size, group, num_splits, prefix_splits) -> None:
    dtype, head_dim, num_kv_heads = torch.float32, 32, 2
    tables, seq_lens, given = shared_batch(groups, singles, block_size, seed=block_size * group + num_splits)
    k, v = caches(tables, seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=group)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(DEVICE)
    scale = head_dim**-0.5
    plain, _ = run(pa, q, k, v, tables, seq_lens, scale, num_splits)
    cascade, shared = run(pa, q, k, v, tables, seq_lens, scale, num_splits, prefix_splits)
    torch.testing.assert_close(cascade, plain, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # The units found are the groups given, whose prefix reaches the minimum (16 keys here).
    expected = [p * block_size if p * block_size >= 16 else 0 for p in given]
    assert shared is not None and shared.skip.tolist() == expected


def test_members_diverging_inside_the_prefix_share_only_the_common_blocks(pa) -> None:
    """Three rows start with the same block but the third leaves the others after 3 of their 5 shared blocks:
    the unit's prefix is the 3 blocks all three hold; the pair's two further blocks stay in their suffixes."""
    bs = 4
    tables = np.array([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 9, 10, 11]], dtype=np.int32)
    seq_lens = np.array([23, 22, 21])
    shared = find_shared_prefixes(tables, seq_lens, bs, max_members=4, min_prefix_tokens=8)
    assert shared is not None and shared.skip.tolist() == [12, 12, 12]
    k, v = caches(tables, seq_lens, bs, 1, 32, torch.float32, seed=3)
    q = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    plain, _ = run(pa, q, k, v, tables, seq_lens, 0.2, 1)
    cascade, _ = run(pa, q, k, v, tables, seq_lens, 0.2, 1, prefix_splits=2, min_prefix_tokens=8)
    torch.testing.assert_close(cascade, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_fp8_cache_cascade_equals_plain(pa) -> None:
    """An e4m3 cache (NaN codes in never-written slots), scales that are no power of two: the prefix kernel
    applies both, as the decode kernel does (a scale missed or applied twice is off by its factor)."""
    tables, seq_lens, _ = shared_batch([(3, [1, 6, 13]), (2, [4, 4])], [11], 4, seed=4)
    k, v = (c.to(torch.float8_e4m3fn) for c in caches(tables, seq_lens, 4, 2, 32, torch.float32, seed=4))
    q = torch.randn(len(seq_lens), 4, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    kv = {"k_scale": torch.tensor(0.37, device=DEVICE), "v_scale": torch.tensor(1.9, device=DEVICE)}
    plain, _ = run(pa, q, k, v, tables, seq_lens, 0.2, 2, **kv)
    cascade, shared = run(pa, q, k, v, tables, seq_lens, 0.2, 2, prefix_splits=2, min_prefix_tokens=8, **kv)
    assert shared is not None and len(shared.units) == 2
    torch.testing.assert_close(cascade, plain, atol=1e-5, rtol=1e-5)


def test_no_shared_block_finds_no_group() -> None:
    """Rows sharing nothing, or whose shared block holds their last key (no suffix left), form no unit."""
    tables = np.array([[1, 2], [3, 4], [5, 0], [5, 0]], dtype=np.int32)
    assert find_shared_prefixes(tables, np.array([8, 8, 4, 3]), 4, max_members=4, min_prefix_tokens=1) is None


def test_cascade_refuses_a_window_and_too_many_partials(pa) -> None:
    tables, seq_lens, _ = shared_batch([(2, [1, 2])], [], 4, seed=0)
    k, v = caches(tables, seq_lens, 4, 1, 32, torch.float32, seed=0)
    q = torch.randn(2, 1, 32).to(DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    cascade = pa.Cascade(torch.zeros(2, **i32), torch.zeros(4, **i32), torch.zeros(2, **i32), 32, 4)
    args = (q, k, v, torch.tensor(tables, **i32), torch.tensor(seq_lens, **i32), torch.arange(3, **i32))
    seqs, out = torch.arange(2, **i32), torch.empty_like(q)
    with pytest.raises(ValueError, match="prefix_splits=32 must be in"):
        pa.paged_decode_attention(*args, seqs, out, 1.0, num_splits=1, cascade=cascade)
    with pytest.raises(ValueError, match="sliding window"):
        pa.paged_decode_attention(*args, seqs, out, 1.0, num_splits=1, window=4, cascade=cascade)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cascade_16bit_on_gpu(pa, dtype) -> None:
    """Qwen3-0.6B's heads (16 over 8, dim 128), block 16: 8 groups of 16 sharing 512 keys, plus singles."""
    groups = [(32, [random.Random(g).randint(1, 200) for _ in range(16)]) for g in range(8)]
    tables, seq_lens, _ = shared_batch(groups, [300, 17, 1000], 16, seed=1)
    k, v = caches(tables, seq_lens, 16, 8, 128, dtype, seed=2)
    q = torch.randn(len(seq_lens), 16, 128).to(dtype).to(DEVICE)
    for num_splits, prefix_splits in ((1, 2), (4, 4)):
        plain, _ = run(pa, q, k, v, tables, seq_lens, 128**-0.5, num_splits)
        cascade, _ = run(pa, q, k, v, tables, seq_lens, 128**-0.5, num_splits, prefix_splits, min_prefix_tokens=128)
        torch.testing.assert_close(cascade, plain, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
