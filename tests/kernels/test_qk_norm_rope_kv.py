"""The fused q/k norm + rotary + paged KV store in Triton against `qk_norm_rope_kv_ref`, its specification.

Head dims 16/24 (the tiny test models; 24 is padded with masks), 64 and 128; GQA groups 1, 2, 4, 8; with
(Qwen3) and without (Llama) the per-head norm; random positions; tokens scattered over shuffled slots of
block sizes 16 and 5, some of them padding (slot -1). The caches start all NaN: every written slot must hold
the reference's k/v, every other slot (padding tokens' included) must stay NaN. q_out is a NaN-poisoned,
strided buffer; qkv rows are strided. Without the norm the kernel repeats torch's roundings exactly, so q and
k must match bit for bit; with it, within the shared tolerance. CPU runs use float32 in Triton's interpreter
(token counts 1, 3, 8, 17); 16-bit and every CUDA-graph batch size up to 512 on GPU.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.qk_norm_rope_kv_ref import qk_norm_rope_kv_ref
from tests.fixtures.triton_kernels import (
    CPU_TOKENS,
    DEVICE,
    GPU_TOKENS,
    HAS_CUDA,
    TOLERANCE,
    assert_only_view_written,
    import_kernel,
    nan_padded,
)

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
EPS = 1e-6
MAX_POSITIONS = 300


@pytest.fixture(scope="module")
def qk():
    return import_kernel("qk_norm_rope_kv")


def rope_tables(head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin [P, D/2] built like the model's RotaryEmbedding."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freqs = torch.arange(MAX_POSITIONS, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def make_case(shape, num_tokens: int, block_size: int, dtype: torch.dtype, norm: bool, seed: int) -> dict:
    """Random inputs on DEVICE: strided qkv, positions, shuffled slots with some padding, NaN caches."""
    num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    _, qkv = nan_padded((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), 4, dtype)
    qkv.copy_(torch.randn(qkv.shape, generator=gen, device=DEVICE))
    num_blocks = num_tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    if num_tokens >= 3:
        slots[num_tokens // 2] = -1  # padding in the middle and at the end, as a padded graph batch has
        slots[-1] = -1
    cos, sin = rope_tables(head_dim)
    weights = [(1 + 0.25 * torch.randn(head_dim, generator=gen, device=DEVICE)).to(dtype) for _ in range(2)]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        qkv=qkv,
        positions=torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen, device=DEVICE),
        cos_cache=cos,
        sin_cache=sin,
        k_cache=torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE),
        v_cache=torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE),
        slot_mapping=slots,
        q_norm_weight=weights[0] if norm else None,
        k_norm_weight=weights[1] if norm else None,
        eps=EPS if norm else None,
    )


def assert_close_per_head(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """|got - ref| <= tol * (1 + the head's largest |ref|): the rotation mixes a head's elements, so a one-ulp
    difference after the norm may land on an output that cancelled to near zero."""
    scale = 1 + ref.float().abs().amax(-1, keepdim=True)
    err = (got.float() - ref.float()).abs() / scale
    assert (err <= tol).all(), f"max error {err.max().item():.3g} (relative to head scale) exceeds {tol}"


def check(qk, case: dict) -> None:
    """Kernel and reference on copies of the same caches."""
    num_tokens, num_kv_heads, head_dim = case["qkv"].shape[0], *case["k_cache"].shape[2:]
    num_heads = case["qkv"].shape[1] // head_dim - 2 * num_kv_heads
    qkv_before = case["qkv"].clone()
    ref_case = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    q_ref = qk_norm_rope_kv_ref(**ref_case)
    q_buf, q_out = nan_padded((num_tokens, num_heads, head_dim), 3, case["qkv"].dtype)
    assert qk.qk_norm_rope_kv(**case, q_out=q_out) is q_out
    assert_only_view_written(q_buf, head_dim)
    torch.testing.assert_close(case["qkv"], qkv_before, atol=0, rtol=0)  # qkv is read only
    assert_matches(case, q_out, ref_case, q_ref)


def assert_matches(case: dict, q_out: torch.Tensor, ref_case: dict, q_ref: torch.Tensor) -> None:
    """q_out everywhere; the caches: the same slots written (the rest still NaN), with the same k and v."""
    assert not q_out.isnan().any(), f"{q_out.isnan().any(-1).sum().item()} query heads were not written"
    for name in ("k_cache", "v_cache"):
        got, ref = case[name], ref_case[name]
        assert torch.equal(got.isnan(), ref.isnan()), f"{name}: slots written that should not be, or missing"
    slots = ref_case["slot_mapping"][ref_case["slot_mapping"] >= 0]
    k_got, v_got = (case[n].flatten(0, 1)[slots] for n in ("k_cache", "v_cache"))  # [n, Hkv, D]
    k_ref, v_ref = (ref_case[n].flatten(0, 1)[slots] for n in ("k_cache", "v_cache"))
    torch.testing.assert_close(v_got, v_ref, atol=0, rtol=0)  # values are copied untouched
    if ref_case["q_norm_weight"] is None:  # products, sums and casts in torch's order: bit for bit
        torch.testing.assert_close(q_out, q_ref, atol=0, rtol=0)
        torch.testing.assert_close(k_got, k_ref, atol=0, rtol=0)
    else:
        assert_close_per_head(q_out, q_ref, TOLERANCE[q_ref.dtype])
        assert_close_per_head(k_got, k_ref, TOLERANCE[q_ref.dtype])


@pytest.mark.parametrize(
    "shape,block_size",
    [((4, 2, 16), 16), ((2, 1, 24), 5), ((1, 1, 64), 16), ((4, 1, 128), 5), ((8, 1, 64), 16)],
    ids=["tiny-qwen3", "gqa2-d24", "gqa1-d64", "gqa4-d128", "gqa8-d64"],
)
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3"])
def test_matches_ref(qk, shape: tuple[int, int, int], block_size: int, norm: bool) -> None:
    """float32 in the interpreter, every CPU token count (odd ones with padding slots). One KV head except the
    tiny Qwen3 shape (4/2 heads): the interpreter's time grows with programs, one per token and KV head."""
    for num_tokens in CPU_TOKENS:
        check(qk, make_case(shape, num_tokens, block_size, torch.float32, norm, seed=num_tokens + block_size))


def test_default_allocation_and_empty(qk) -> None:
    """Without q_out a fresh contiguous [T, H, D] comes back; an empty batch launches nothing."""
    case = make_case((4, 2, 16), 3, 16, torch.float32, norm=True, seed=1)
    q = qk.qk_norm_rope_kv(**case)
    assert q.is_contiguous() and q.shape == (3, 4, 16)
    empty = dict(case, qkv=case["qkv"][:0], positions=case["positions"][:0], slot_mapping=case["slot_mapping"][:0])
    assert qk.qk_norm_rope_kv(**empty).shape == (0, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3"])
def test_ref_is_the_model_code(qk, dtype: torch.dtype, norm: bool) -> None:
    """The reference equals the model's own path bit for bit (plain torch on CPU): split, Qwen3's q_norm/k_norm
    RMSNorm modules, RotaryEmbedding tables and apply_rotary, then store_kv."""
    from asyncllm.attention.torch_ref import store_kv
    from asyncllm.layers.norm import RMSNorm
    from asyncllm.layers.rotary import RotaryEmbedding, apply_rotary

    heads, kv_heads, dim, tokens = 4, 2, 24, 9
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(dim, MAX_POSITIONS, 10000.0, None)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen)
    slots = torch.randperm(4 * 16, generator=gen)[:tokens]
    caches = [torch.full((4, 16, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(4)]
    q_norm, k_norm = RMSNorm(dim, EPS), RMSNorm(dim, EPS)
    with torch.no_grad():
        for w in (q_norm.weight, k_norm.weight):
            w.copy_(1 + 0.25 * torch.randn(dim, generator=gen))
        q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
        if norm:
            q, k = q_norm(q), k_norm(k)
        cos, sin = rope(positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        store_kv(k, v, caches[0], caches[1], slots)
        weights = dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, eps=EPS) if norm else {}
        got = qk_norm_rope_kv_ref(
            qkv, positions, rope.cos_cache, rope.sin_cache, caches[2], caches[3], slots, **weights
        )
    torch.testing.assert_close(got, q, atol=0, rtol=0)
    torch.testing.assert_close(caches[2], caches[0], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0, equal_nan=True)


def test_launcher_rejects_bad_inputs(qk) -> None:
    case = make_case((4, 2, 16), 3, 16, torch.float32, norm=True, seed=2)

    def call(**changes) -> None:
        qk.qk_norm_rope_kv(**dict(case, **changes))

    with pytest.raises(ValueError, match="qkv width 120"):
        call(qkv=case["qkv"][:, :120])
    with pytest.raises(ValueError, match="not a multiple"):
        call(qkv=case["qkv"][:, : (3 + 4) * 16])  # 3 query heads over 2 KV heads
    with pytest.raises(TypeError, match="float64"):
        call(**{n: case[n].double() for n in ("qkv", "k_cache", "v_cache", "q_norm_weight", "k_norm_weight")})
    with pytest.raises(TypeError, match=r"slot_mapping has dtype torch\.int32"):
        call(slot_mapping=case["slot_mapping"].int())
    with pytest.raises(ValueError, match="positions shape"):
        call(positions=case["positions"][:2])
    with pytest.raises(ValueError, match="cos_cache must be float32"):
        call(cos_cache=case["cos_cache"][:, :4])
    with pytest.raises(ValueError, match="go together"):
        call(k_norm_weight=None)
    with pytest.raises(ValueError, match="eps is required"):
        call(eps=None)
    with pytest.raises(ValueError, match="k_norm_weight shape"):
        call(k_norm_weight=case["k_norm_weight"][:8])
    with pytest.raises(TypeError, match="caches have dtypes"):
        call(k_cache=case["k_cache"].half(), v_cache=case["v_cache"].half())
    with pytest.raises(ValueError, match="stride"):
        call(qkv=torch.randn(case["qkv"].shape[::-1], device=DEVICE).t())
    with pytest.raises(ValueError, match="q_out must be"):
        call(q_out=torch.empty(3, 4, 17, device=DEVICE))


# ------------------------------------------------------------------------------------------- GPU only
GPU_SHAPES = [(16, 8, 128), (32, 8, 128), (4, 2, 16), (4, 2, 24), (8, 1, 64), (8, 8, 64)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3"])
def test_gpu_matches_ref(qk, dtype: torch.dtype, shape: tuple[int, int, int], norm: bool) -> None:
    """Qwen3-0.6B/8B heads and the tiny ones, every CUDA-graph batch size and odd token counts, every dtype
    (bit for bit without the norm: fused multiply-adds are disabled for this kernel)."""
    for num_tokens in GPU_TOKENS:
        check(qk, make_case(shape, num_tokens, 16, dtype, norm, seed=num_tokens))


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay(qk) -> None:
    """Captured once, replayed over fresh inputs (padding slots included) copied into the static buffers."""
    static = make_case((16, 8, 128), 32, 16, torch.bfloat16, norm=True, seed=3)
    q_out = qk.qk_norm_rope_kv(**static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qk.qk_norm_rope_kv(**static, q_out=q_out)
    for seed in (4, 5):
        fresh = make_case((16, 8, 128), 32, 16, torch.bfloat16, norm=True, seed=seed)
        for name in ("qkv", "positions", "slot_mapping", "k_cache", "v_cache", "q_norm_weight", "k_norm_weight"):
            static[name].copy_(fresh[name])
        ref_case = dict(fresh, k_cache=fresh["k_cache"].clone(), v_cache=fresh["v_cache"].clone())
        q_ref = qk_norm_rope_kv_ref(**ref_case)
        q_out.fill_(float("nan"))
        graph.replay()
        assert_matches(static, q_out, ref_case, q_ref)
