"""The batched LoRA kernels (the fused launch, and the split-K shrink then expand) against `lora_ref`, their
specification, and the host plans (rows per block, launch shapes).

Random mixes of slots and tokens without an adapter, prefill-like runs of one sequence and decode-like single
rows, one to three output shards (unpacked, gate/up, q/k/v) of odd sizes, inputs whose width is no multiple of
the K tile, padded ranks 16, 32 and 64 (and a rank-8 adapter zero-padded to 16), K split 1 to 5 ways, a
strided slot dimension (the views of a pool). Rows without an adapter must come back bit for bit; token counts
1, 3, 8, 17 on CPU (Triton's interpreter, float32) and every CUDA-graph batch size plus odd ones on GPU, where
bf16 and a captured graph replayed over new block tables run too.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncllm.kernels.lora_plan import (
    FUSED_WARPS,
    LORA_BLOCK_M,
    SPLIT_WARPS,
    LoRALaunch,
    max_lora_blocks,
    plan_lora_blocks,
    plan_lora_launch,
    token_slots,
)
from asyncllm.kernels.lora_ref import lora_ref
from tests.fixtures.triton_kernels import CPU_TOKENS, DEVICE, GPU_TOKENS, HAS_CUDA, TOLERANCE, import_kernel

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
SHARDS = [(48,), (40, 40), (64, 16, 16), (100,)]


@pytest.fixture(scope="module")
def lora():
    return import_kernel("lora")


def _mix(num_tokens: int, num_slots: int, seed: int) -> tuple[list[int], list[int]]:
    """Sequences covering `num_tokens` rows (some long, most one row) with random slots, -1 among them."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < num_tokens:
        lens.append(min(num_tokens - sum(lens), rng.choice([1, 1, 1, 2, 7, 19])))
    return [rng.randrange(-1, num_slots) for _ in lens], lens


def _weights(num_slots: int, shards: tuple[int, ...], k: int, rank: int, dtype: torch.dtype, seed: int):
    """a [slots, S * R, K] and b [slots, N, R] as strided views of one pool row per slot, scaled for O(1) outputs."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n_a, n_b = len(shards) * rank * k, sum(shards) * rank
    pool = torch.randn(num_slots, n_a + n_b + 8, generator=gen, device=DEVICE)
    pool[:, :n_a] /= k**0.5
    pool[:, n_a:] /= rank**0.5
    pool = pool.to(dtype)
    return pool[:, :n_a].view(num_slots, -1, k), pool[:, n_a : n_a + n_b].view(num_slots, -1, rank)


def check(
    lora,
    num_tokens: int,
    shards: tuple[int, ...],
    dtype: torch.dtype,
    seed: int,
    k: int = 72,
    rank: int = 16,
    launch: LoRALaunch | None = None,
    adapter_rank: int | None = None,
):
    """`lora_add` (the launch given, or the planned one) against `lora_ref`; `adapter_rank` below `rank`: the
    slots' rank rows past it are zero, as a smaller adapter sits in a padded slot."""
    num_slots = 3
    a, b = _weights(num_slots, shards, k, rank, dtype, seed)
    if adapter_rank is not None:
        a.view(num_slots, len(shards), rank, k)[:, :, adapter_rank:] = 0
        b[:, :, adapter_rank:] = 0
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(num_tokens, k, generator=gen, device=DEVICE).to(dtype)
    y = torch.randn(num_tokens, sum(shards), generator=gen, device=DEVICE).to(dtype)
    seq_slots, lens = _mix(num_tokens, num_slots, seed)
    block_tokens, block_slot = plan_lora_blocks(seq_slots, lens, num_slots, num_tokens)
    slots = torch.tensor(token_slots(seq_slots, lens, num_tokens), device=DEVICE)
    expected = lora_ref(x, y.clone(), a, b, slots, shards)
    out = lora.lora_add(
        x,
        y.clone(),
        a,
        b,
        torch.tensor(block_tokens, dtype=torch.int32, device=DEVICE),
        torch.tensor(block_slot, dtype=torch.int32, device=DEVICE),
        shards,
        launch,
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    untouched = slots < 0
    assert torch.equal(out[untouched], y[untouched]), "a row without an adapter changed"
    assert not torch.equal(out[~untouched], y[~untouched]) or not (~untouched).any()


def _forced(
    path: str, block_n: int = 16, block_k: int = 32, splits: int = 1, k_chunk: int = 96, tiles: int = 1
) -> LoRALaunch:
    return LoRALaunch(path, block_n, block_k, splits, k_chunk, tiles)  # type: ignore[arg-type]


# (name, launch): the plan's choice, the fused launch with several column tiles per shard and K tiles per
# program, then with 2 and 3 tiles a program (a shard's last program partly or wholly past its columns), the
# split path with K in 3 chunks of 2 tiles (the last one partial) and in one chunk
LAUNCHES = [
    ("planned", None),
    ("fused", _forced("fused")),
    ("fused2", _forced("fused", tiles=2)),
    ("fused3", _forced("fused", tiles=3)),
    ("split3", _forced("split", splits=3, k_chunk=32, block_k=16)),
    ("split1", _forced("split", block_n=32, block_k=128, k_chunk=128)),
]


@pytest.mark.parametrize("launch", [launch for _, launch in LAUNCHES], ids=[name for name, _ in LAUNCHES])
@pytest.mark.parametrize("shards", SHARDS, ids=str)
@pytest.mark.slow
def test_matches_ref(lora, shards: tuple[int, ...], launch: LoRALaunch | None) -> None:
    for num_tokens in CPU_TOKENS:
        check(lora, num_tokens, shards, torch.float32, seed=num_tokens + sum(shards), launch=launch)


@pytest.mark.parametrize("path", ["fused", "split"])
@pytest.mark.slow
def test_larger_ranks_and_wide_input(lora, path: str) -> None:
    """Ranks 32, 64 and 128 (the expand sums its partial sums in turn past 64), an input wider than one K tile
    and not a multiple of it (split 5 ways on the split path), several blocks per slot, q/k/v-like shards; a
    rank-8 adapter in a slot of rank 16."""
    for rank in (32, 64, 128):
        launch = plan_lora_launch(41, 3, 200, (24, 8, 8), rank, 4, path)  # type: ignore[arg-type]
        check(lora, 41, (24, 8, 8), torch.float32, seed=5 + rank, k=200, rank=rank, launch=launch)
    split = _forced(path, splits=5 if path == "split" else 1, k_chunk=48 if path == "split" else 208, block_k=16)
    check(lora, 41, (24, 24), torch.float32, seed=5, k=200, launch=split)
    check(lora, 19, (40,), torch.float32, seed=6, k=200, launch=split, adapter_rank=8)
    if path == "split":  # the most partial sums the expand takes, each over a K tile of its own
        check(lora, 19, (40, 8), torch.float32, seed=7, k=128, launch=_forced(path, splits=8, k_chunk=16, block_k=16))


def test_every_row_of_one_slot_and_none_at_all(lora) -> None:
    num_tokens, shards = 20, (32,)
    a, b = _weights(2, shards, 64, 16, torch.float32, seed=9)
    x = torch.randn(num_tokens, 64, device=DEVICE)
    y = torch.randn(num_tokens, 32, device=DEVICE)
    for seq_slots in ([1] * num_tokens, [-1] * num_tokens):
        tokens, blocks = plan_lora_blocks(seq_slots, [1] * num_tokens, 2, num_tokens)
        slots = torch.tensor(seq_slots, device=DEVICE)
        bt, bs = (torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (tokens, blocks))
        for launch in (_forced("fused"), _forced("split", splits=2, k_chunk=32)):
            out = lora.lora_add(x, y.clone(), a, b, bt, bs, shards, launch)
            torch.testing.assert_close(out, lora_ref(x, y.clone(), a, b, slots, shards), atol=1e-5, rtol=1e-5)


def _plan_blocks_ref(
    seq_slots: list[int], lens: list[int], num_slots: int, num_tokens: int
) -> tuple[list[int], list[int]]:
    """`plan_lora_blocks` row by row in plain Python: each slot's rows in row order, slots in order."""
    rows: list[list[int]] = [[] for _ in range(num_slots)]
    t = 0
    for slot, n in zip(seq_slots, lens):
        if slot >= 0:
            rows[slot] += range(t, t + n)
        t += n
    tokens: list[int] = []
    blocks: list[int] = []
    for slot, slot_rows in enumerate(rows):
        num_blocks = -(-len(slot_rows) // LORA_BLOCK_M)
        tokens += slot_rows + [-1] * (num_blocks * LORA_BLOCK_M - len(slot_rows))
        blocks += [slot] * num_blocks
    return tokens, blocks + [-1] * (max_lora_blocks(num_tokens, num_slots) - len(blocks))


def test_plan_puts_every_row_in_its_slots_blocks_once() -> None:
    for seed in range(40):
        num_tokens = 1 + seed * 7
        seq_slots, lens = _mix(num_tokens, 4, seed)
        if seed % 2:  # decode-like: one row a sequence
            lens = [1] * len(seq_slots)
            num_tokens = len(seq_slots)
        # 5 padding rows; a bucket's padded sequence lengths past the sequences' are ignored
        tokens_np, blocks_np = plan_lora_blocks(seq_slots, [*lens, 1, 1], 4, num_tokens + 5)
        assert tokens_np.dtype == blocks_np.dtype == np.int32
        tokens, blocks = tokens_np.tolist(), blocks_np.tolist()
        assert (tokens, blocks) == _plan_blocks_ref(seq_slots, lens, 4, num_tokens + 5)
        assert len(blocks) == max_lora_blocks(num_tokens + 5, 4)
        used = [s for s in blocks if s >= 0]
        assert blocks[len(used) :] == [-1] * (len(blocks) - len(used)), "used blocks first"
        assert len(tokens) == len(used) * LORA_BLOCK_M
        per_row = token_slots(seq_slots, lens, num_tokens + 5).tolist()
        seen = {t: used[i // LORA_BLOCK_M] for i, t in enumerate(tokens) if t >= 0}
        assert seen == {t: s for t, s in enumerate(per_row) if s >= 0}
        assert len([t for t in tokens if t >= 0]) == len(seen)
    no_rows, no_blocks = plan_lora_blocks([-1, -1], [3, 1], 2, 4)
    assert no_rows.size == 0 and no_blocks.tolist() == [-1] * max_lora_blocks(4, 2)


def test_launch_plan_covers_k_and_bounds_tiles_by_rank() -> None:
    """Every K split is non-empty and together they cover K; tiles shrink as the rank grows (shared memory);
    the choice depends on shapes only, so a graph captured for T rows replays any step of T rows."""
    for k in (16, 72, 1000, 1024, 2048, 3072, 8192):
        for rank in (16, 64, 512):
            for num_tokens in (1, 64, 256, 2048):
                for shards in ((1024,), (2048, 1024, 1024), (3072, 3072)):
                    for path in ("fused", "split", None):
                        launch = plan_lora_launch(num_tokens, 8, k, shards, rank, 2, path)  # type: ignore[arg-type]
                        assert launch.splits * launch.k_chunk >= k > (launch.splits - 1) * launch.k_chunk
                        warps = FUSED_WARPS if launch.path == "fused" else SPLIT_WARPS
                        assert launch.block_n * rank <= 8192 or launch.block_n == 16
                        assert (16 + rank) * launch.block_k * 2 <= 256 * 32 * warps or launch.block_k == 16
    qkv, gate_up = (2048, 1024, 1024), (3072, 3072)
    assert plan_lora_launch(1, 8, 1024, qkv, 16, 2).path == "fused"  # a decode row: one launch
    decode = plan_lora_launch(256, 8, 1024, gate_up, 16, 2)  # one launch, two tiles a program: few re-reads
    assert (decode.path, decode.tiles) == ("fused", 2)
    prefill = plan_lora_launch(2048, 8, 1024, qkv, 16, 2)  # a prefill chunk: one launch, no re-reads
    assert prefill.path == "fused" and prefill.tiles * prefill.block_n >= 2048
    assert plan_lora_launch(1, 8, 3072, (1024,), 16, 2).path == "split"  # a long K, a small grid: split it
    assert plan_lora_launch(64, 8, 3072, (1024,), 16, 2).splits > 1
    assert plan_lora_launch(2048, 8, 3072, (1024,), 16, 2).path == "split"  # a long K, still few row blocks
    assert plan_lora_launch(2048, 8, 1024, (1024,) * 3, 16, 2).path == "fused"  # the row blocks fill the device
    big = plan_lora_launch(8192, 8, 3072, (1024,), 16, 2)  # so many rows that re-shrinks outweigh a launch
    assert (big.path, big.splits) == ("split", 1)


def test_launch_shape_is_checked(lora) -> None:
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        LoRALaunch("fused", 24, 16, 1, 16)
    with pytest.raises(ValueError, match="k_chunk a multiple of block_k 32"):
        LoRALaunch("split", 16, 32, 2, 48)
    with pytest.raises(ValueError, match="splits=1"):
        LoRALaunch("fused", 16, 16, 2, 32)
    with pytest.raises(ValueError, match=r"splits must be 1\.\.8"):
        LoRALaunch("split", 16, 16, 9, 16)
    with pytest.raises(ValueError, match="tiles must be >= 1"):
        LoRALaunch("fused", 16, 16, 1, 16, tiles=0)
    with pytest.raises(ValueError, match="1 on the split path"):
        LoRALaunch("split", 16, 16, 2, 16, tiles=2)
    a, b = _weights(2, (32,), 64, 16, torch.float32, seed=1)
    x, y = torch.randn(4, 64, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    tokens, blocks = plan_lora_blocks([0], [4], 2, 4)
    bt, bs = (torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (tokens, blocks))
    for launch in (LoRALaunch("fused", 16, 16, 1, 32), LoRALaunch("split", 16, 16, 2, 16)):
        with pytest.raises(ValueError, match="does not cover K=64"):
            lora.lora_add(x, y, a, b, bt, bs, (32,), launch)


def test_launchers_reject_bad_inputs(lora) -> None:
    a, b = _weights(2, (32,), 64, 16, torch.float32, seed=1)
    x, y = torch.randn(4, 64, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    tokens, blocks = plan_lora_blocks([0], [4], 2, 4)
    bt, bs = (torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (tokens, blocks))
    with pytest.raises(ValueError, match="disagree"):
        lora.lora_add(x[:, :60], y, a, b, bt, bs, (32,))
    with pytest.raises(ValueError, match="summing to y's 32"):
        lora.lora_add(x, y, a, b, bt, bs, (20,))
    with pytest.raises(TypeError, match="int32"):
        lora.lora_add(x, y, a, b, bt.long(), bs, (32,))
    with pytest.raises(ValueError, match="block_slot has 1 entries"):
        lora.lora_add(x, y, a, b, bt, bs[:1], (32,))
    a8, b8 = _weights(2, (32,), 64, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="power of two >= 16"):
        lora.lora_add(x, y, a8, b8, bt, bs, (32,))
    with pytest.raises(TypeError, match="share a float dtype"):
        lora.lora_add(x.double(), y, a, b, bt, bs, (32,))


def test_layer_launcher_plans_each_shape_once_and_checks_new_tables(lora) -> None:
    """`LoRAAdd` (one layer's launches, checked and planned once per shape of call) gives `lora_ref`'s result
    for every row count and path, repeated shapes included, and checks what it has not seen: block tables
    (a short one is refused) and inputs of another shape."""
    shards, k = (40, 24), 72
    a, b = _weights(3, shards, k, 16, torch.float32, seed=11)
    add = lora.LoRAAdd(a, b, shards)
    for num_tokens in (3, 17, 3):
        for path in (None, "fused", "split"):
            x = torch.randn(num_tokens, k, device=DEVICE)
            y = torch.randn(num_tokens, sum(shards), device=DEVICE)
            seq_slots, lens = _mix(num_tokens, 3, seed=num_tokens)
            bt, bs = (torch.as_tensor(v, device=DEVICE) for v in plan_lora_blocks(seq_slots, lens, 3, num_tokens))
            slots = torch.as_tensor(token_slots(seq_slots, lens, num_tokens), device=DEVICE)
            out = add(x, y.clone(), bt, bs, path)
            torch.testing.assert_close(out, lora_ref(x, y.clone(), a, b, slots, shards), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block_slot has 1 entries"):
        add(x, y, bt, bs[:1])
    with pytest.raises(ValueError, match="disagree"):
        add(x[:, : k - 2], y, bt, bs)


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="on CUDA the GPU tests compile and run the kernels themselves")
def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    """Triton's compiler (not the interpreter) builds the fused, shrink and expand kernels for sm_90 at the
    launches the plan picks, within sm_90's shared memory (the interpreter accepts what the compiler refuses)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("hopper_compile_lora.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # asyncllm as this process finds it
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.count("ok ") == 15 and "fused" in out.stdout and "split" in out.stdout, out.stdout


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["fused", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shards", [(1024,), (3072, 3072), (2048, 1024, 1024)], ids=str)
def test_gpu_matches_ref(lora, dtype: torch.dtype, shards: tuple[int, ...], path: str) -> None:
    """Both paths at every graph size; the unpacked layer with down's K (3072: split 6 ways at decode sizes)."""
    k = 3072 if len(shards) == 1 else 1024
    itemsize = torch.empty(0, dtype=dtype).element_size()
    for num_tokens in GPU_TOKENS:
        launch = plan_lora_launch(num_tokens, 3, k, shards, 16, itemsize, path)  # type: ignore[arg-type]
        check(lora, num_tokens, shards, dtype, seed=num_tokens, k=k, launch=launch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["fused", "split"])
def test_gpu_cuda_graph_replay(lora, path: str) -> None:
    """Captured once for 64 rows, replayed over other mixes written into the same block tables."""
    num_tokens, shards, num_slots, dtype = 64, (2048, 1024, 1024), 3, torch.bfloat16
    a, b = _weights(num_slots, shards, 1024, 16, dtype, seed=2)
    x = torch.randn(num_tokens, 1024, device=DEVICE, dtype=dtype)
    y = torch.empty(num_tokens, sum(shards), device=DEVICE, dtype=dtype)
    grid = max_lora_blocks(num_tokens, num_slots)
    bt = torch.full((grid * LORA_BLOCK_M,), -1, dtype=torch.int32, device=DEVICE)
    bs = torch.full((grid,), -1, dtype=torch.int32, device=DEVICE)
    lora.lora_add(x, y, a, b, bt, bs, shards, path=path)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora.lora_add(x, y, a, b, bt, bs, shards, path=path)
    for seed in (3, 4, 5):
        seq_slots, lens = _mix(num_tokens, num_slots, seed)
        tokens, blocks = plan_lora_blocks(seq_slots, lens, num_slots, num_tokens)
        bt[: len(tokens)].copy_(torch.tensor(tokens, dtype=torch.int32))
        bs.copy_(torch.tensor(blocks, dtype=torch.int32))
        y.copy_(torch.randn(num_tokens, sum(shards), device=DEVICE, dtype=dtype))
        expected = lora_ref(x, y.clone(), a, b, torch.tensor(token_slots(seq_slots, lens, num_tokens)).cuda(), shards)
        graph.replay()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(y, expected, atol=tol, rtol=tol)
