"""The batched LoRA kernels (shrink, expand) against `lora_ref`, their specification, and the host plan.

Random mixes of slots and tokens without an adapter, prefill-like runs of one sequence and decode-like single
rows, one to three output shards (unpacked, gate/up, q/k/v) of odd sizes, inputs whose width is no multiple of
the K tile, padded ranks 16 and 32, a strided slot dimension (the views of a pool). Rows without an adapter
must come back bit for bit; token counts 1, 3, 8, 17 on CPU (Triton's interpreter, float32) and every CUDA-graph
batch size plus odd ones on GPU, where bf16 and a captured graph replayed over new block tables run too.
"""

from __future__ import annotations

import random

import pytest
import torch
from asyncllm.kernels.lora_plan import LORA_BLOCK_M, max_lora_blocks, plan_lora_blocks, token_slots
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


def check(lora, num_tokens: int, shards: tuple[int, ...], dtype: torch.dtype, seed: int, k: int = 72, rank: int = 16):
    num_slots = 3
    a, b = _weights(num_slots, shards, k, rank, dtype, seed)
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
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    untouched = slots < 0
    assert torch.equal(out[untouched], y[untouched]), "a row without an adapter changed"
    assert not torch.equal(out[~untouched], y[~untouched]) or not (~untouched).any()


@pytest.mark.parametrize("shards", SHARDS, ids=str)
def test_matches_ref(lora, shards: tuple[int, ...]) -> None:
    for num_tokens in CPU_TOKENS:
        check(lora, num_tokens, shards, torch.float32, seed=num_tokens + sum(shards))


def test_larger_rank_and_wide_input(lora) -> None:
    """Rank 32, an input wider than one K tile and not a multiple of it, several blocks per slot."""
    check(lora, 41, (24, 24), torch.float32, seed=5, k=200, rank=32)


def test_every_row_of_one_slot_and_none_at_all(lora) -> None:
    num_tokens, shards = 20, (32,)
    a, b = _weights(2, shards, 64, 16, torch.float32, seed=9)
    x = torch.randn(num_tokens, 64, device=DEVICE)
    y = torch.randn(num_tokens, 32, device=DEVICE)
    for seq_slots in ([1] * num_tokens, [-1] * num_tokens):
        tokens, blocks = plan_lora_blocks(seq_slots, [1] * num_tokens, 2, num_tokens)
        slots = torch.tensor(seq_slots, device=DEVICE)
        bt, bs = (torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (tokens, blocks))
        out = lora.lora_add(x, y.clone(), a, b, bt, bs, shards)
        torch.testing.assert_close(out, lora_ref(x, y.clone(), a, b, slots, shards), atol=1e-5, rtol=1e-5)


def test_plan_puts_every_row_in_its_slots_blocks_once() -> None:
    for seed in range(20):
        num_tokens = 1 + seed * 7
        seq_slots, lens = _mix(num_tokens, 4, seed)
        tokens, blocks = plan_lora_blocks(seq_slots, lens, 4, num_tokens + 5)  # 5 padding rows
        assert len(blocks) == max_lora_blocks(num_tokens + 5, 4)
        used = [s for s in blocks if s >= 0]
        assert blocks[len(used) :] == [-1] * (len(blocks) - len(used)), "used blocks first"
        assert len(tokens) == len(used) * LORA_BLOCK_M
        per_row = token_slots(seq_slots, lens, num_tokens + 5)
        seen = {t: used[i // LORA_BLOCK_M] for i, t in enumerate(tokens) if t >= 0}
        assert seen == {t: s for t, s in enumerate(per_row) if s >= 0}
        assert len([t for t in tokens if t >= 0]) == len(seen)


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


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shards", [(1024,), (3072, 3072), (2048, 1024, 1024)], ids=str)
def test_gpu_matches_ref(lora, dtype: torch.dtype, shards: tuple[int, ...]) -> None:
    for num_tokens in GPU_TOKENS:
        check(lora, num_tokens, shards, dtype, seed=num_tokens, k=1024)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay(lora) -> None:
    """Captured once for 64 rows, replayed over other mixes written into the same block tables."""
    num_tokens, shards, num_slots, dtype = 64, (2048, 1024, 1024), 3, torch.bfloat16
    a, b = _weights(num_slots, shards, 1024, 16, dtype, seed=2)
    x = torch.randn(num_tokens, 1024, device=DEVICE, dtype=dtype)
    y = torch.empty(num_tokens, sum(shards), device=DEVICE, dtype=dtype)
    grid = max_lora_blocks(num_tokens, num_slots)
    bt = torch.full((grid * LORA_BLOCK_M,), -1, dtype=torch.int32, device=DEVICE)
    bs = torch.full((grid,), -1, dtype=torch.int32, device=DEVICE)
    lora.lora_add(x, y, a, b, bt, bs, shards)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora.lora_add(x, y, a, b, bt, bs, shards)
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
