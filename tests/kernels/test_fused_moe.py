"""The Triton MoE kernels against their specification (`asyncllm.kernels.moe_ref`), and the specification
against transformers' Qwen3-MoE router and experts.

Grouping (`moe_align`) must equal `align_ref` exactly: decode (one token), top-8 of 128 experts (most receive
no row), routing skewed onto two experts (groups over several blocks), several grouping programs. The experts
(`fused_moe`) within the shared tolerance over the shapes the models use: hidden and intermediate sizes that
are not multiples of the tiles, one rank's slice under tensor parallelism (I = 8). CPU runs use float32 in
Triton's interpreter; 16-bit, the Qwen3-30B-A3B shape and CUDA-graph replay on GPU.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.moe_ref import align_ref, experts_ref, padded_capacity, route_ref
from tests.fixtures.triton_kernels import CUDA_GRAPH_SIZES, DEVICE, HAS_CUDA, TOLERANCE, import_kernel

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def fm():
    return import_kernel("fused_moe")


def routed(num_tokens: int, num_experts: int, top_k: int, seed: int, skew: bool = False):
    """(weights [T, K] float32, ids [T, K] int64) from random router logits; `skew`: two experts favoured."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = 2 * torch.randn(num_tokens, num_experts, generator=gen, device=DEVICE)
    if skew:
        logits[:, :2] += 100.0
    return route_ref(logits, top_k, renormalize=seed % 2 == 0)


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=DEVICE) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=DEVICE) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def check(fm, num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype, seed: int, skew=False):
    w13, w2 = experts(num_experts, hidden, inter, dtype, seed)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator(device=DEVICE).manual_seed(seed + 1), device=DEVICE)
    x = x.to(dtype)
    weights, ids = routed(num_tokens, num_experts, top_k, seed, skew)
    weights = weights.to(dtype)
    got = fm.fused_moe(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == dtype
    want = experts_ref(x, w13, w2, weights, ids)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


ALIGN_CASES = [  # (tokens, experts, top_k, block_m, skew)
    (1, 8, 2, 16, False),  # decode at batch 1
    (3, 128, 8, 16, False),  # top-8 of 128: most experts get no row
    (17, 8, 2, 16, True),  # two experts take every row: groups of 17 over two blocks
    (40, 8, 4, 64, False),
    (150, 16, 2, 16, False),  # 300 routed rows: two grouping programs
]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m", "skew"), ALIGN_CASES)
def test_align_equals_ref(fm, num_tokens: int, num_experts: int, top_k: int, block_m: int, skew: bool) -> None:
    _, ids = routed(num_tokens, num_experts, top_k, seed=num_tokens, skew=skew)
    got = fm.moe_align(ids, num_experts, block_m)
    want = align_ref(ids, num_experts, block_m)
    for name, g, w in zip(("sorted_slots", "block_experts", "num_rows"), got, want):
        assert torch.equal(g, w), name
    sorted_slots, _, num_rows = want
    assert sorted_slots.numel() == padded_capacity(ids.numel(), num_experts, block_m)
    used = sorted_slots[: int(num_rows)]
    assert sorted(used[used < ids.numel()].tolist()) == list(range(ids.numel())), "every routed row exactly once"


SHAPES = [  # (tokens, hidden, intermediate, experts, top_k)
    (1, 64, 32, 8, 2),  # the tiny test model at decode
    (5, 64, 8, 8, 2),  # one rank's slice at tensor_parallel_size=4 (I = 32 / 4)
    (3, 64, 48, 128, 8),  # top-8 of 128 experts
    (17, 40, 24, 16, 4),  # hidden and intermediate sizes that are not multiples of the tiles
]


@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k"), SHAPES)
def test_matches_ref(fm, num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int) -> None:
    check(fm, num_tokens, hidden, inter, num_experts, top_k, torch.float32, seed=num_tokens + inter)


def test_skewed_routing_and_large_blocks(fm) -> None:
    """Every token's two picks in experts 0 and 1: 80 routed rows, blocks of 64 rows (over 16 experts' rows)."""
    check(fm, 40, 64, 32, 4, 2, torch.float32, seed=3, skew=True)
    assert fm.block_m_for(40 * 2, 4) == 64


def test_deterministic_and_empty(fm) -> None:
    """The same inputs give the same bits (placement within a group never changes a row's sum); no token, no
    launch."""
    w13, w2 = experts(8, 64, 32, torch.float32, seed=5)
    x = torch.randn(9, 64, device=DEVICE)
    weights, ids = routed(9, 8, 2, seed=5)
    assert torch.equal(fm.fused_moe(x, w13, w2, weights, ids), fm.fused_moe(x, w13, w2, weights, ids))
    assert fm.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 64)


def test_launcher_rejects_bad_inputs(fm) -> None:
    w13, w2 = experts(8, 64, 32, torch.float32, seed=6)
    x = torch.randn(4, 64, device=DEVICE)
    weights, ids = routed(4, 8, 2, seed=6)
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2 \* I, H=64\]"):
        fm.fused_moe(x, w13[:, :, :32], w2, weights, ids)
    with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\]"):
        fm.fused_moe(x, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(TypeError, match=r"w2 has dtype torch\.float16"):
        fm.fused_moe(x, w13, w2.half(), weights, ids)
    with pytest.raises(ValueError, match="weights and ids must both be"):
        fm.fused_moe(x, w13, w2, weights[:3], ids[:3])
    with pytest.raises(TypeError, match="float64"):
        fm.fused_moe(x.double(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="block_m=24"):
        fm.moe_align(ids, 8, 24)


@pytest.mark.parametrize("renormalize", [True, False])
def test_ref_is_transformers_qwen3_moe(renormalize: bool) -> None:
    """route_ref and experts_ref equal transformers' Qwen3-MoE router and experts bit for bit (float32, CPU)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=renormalize
    )
    torch.manual_seed(7)
    router, hf_experts = Qwen3MoeTopKRouter(config), Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in (router.weight, hf_experts.gate_up_proj, hf_experts.down_proj):
            p.normal_(0.0, 0.2)
    x = torch.randn(11, 64)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
        weights, ids = route_ref(logits, 2, renormalize)
        torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
        assert torch.equal(ids, hf_ids)
        want = hf_experts(x, hf_ids, hf_weights)
        got = experts_ref(x, hf_experts.gate_up_proj, hf_experts.down_proj, weights, ids)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------- GPU only
QWEN3_30B = dict(hidden=2048, inter=768, num_experts=128, top_k=8)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("inter", [768, 384], ids=["tp1", "tp2"])
def test_gpu_qwen3_30b_shape(fm, dtype: torch.dtype, inter: int) -> None:
    """The Qwen3-30B-A3B experts (and one rank's half at TP=2) at every CUDA-graph batch size and prefill sizes."""
    shape = QWEN3_30B | dict(inter=inter)
    for num_tokens in [*CUDA_GRAPH_SIZES[:8], 100, 256, 512, 2048, 8192]:
        check(fm, num_tokens, **shape, dtype=dtype, seed=num_tokens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m", "skew"), ALIGN_CASES)
def test_gpu_align_equals_ref(fm, num_tokens: int, num_experts: int, top_k: int, block_m: int, skew: bool) -> None:
    test_align_equals_ref(fm, num_tokens, num_experts, top_k, block_m, skew)
    _, ids = routed(8192, 128, 8, seed=1)  # 65,536 routed rows: 256 grouping programs
    for g, w in zip(fm.moe_align(ids, 128, 64), align_ref(ids, 128, 64)):
        assert torch.equal(g, w)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay(fm) -> None:
    """Captured once, replayed over fresh routing (other experts, other group sizes): no host sync, no
    routing-dependent shape."""
    w13, w2 = experts(128, 2048, 768, torch.bfloat16, seed=1)
    x = torch.randn(64, 2048, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = routed(64, 128, 8, seed=1)
    weights = weights.to(torch.bfloat16)
    fm.fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w13, w2, weights, ids)
    for seed in (2, 3):
        new_weights, new_ids = routed(64, 128, 8, seed=seed, skew=seed == 3)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(torch.randn(64, 2048, device=DEVICE))
        graph.replay()
        tol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out, experts_ref(x, w13, w2, weights, ids), atol=tol, rtol=tol)
