"""The FP8 KV cache's write: `quantize_kv` (kernels/kv_cache_fp8_ref.py) against e4m3's grid enumerated here, and
the fused q/k norm + rotary + KV write (kernels/qk_norm_rope_kv.py) into an e4m3 cache against its reference:
the same codes, saturated at +-448, rounded to nearest with ties to even, in the slots written and nowhere else.
CPU runs use float32 in Triton's interpreter; 16-bit on GPU."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.kv_cache_fp8_ref import E4M3_MAX, quantize_kv, read_kv, write_kv
from asyncllm.kernels.qk_norm_rope_kv_ref import qk_norm_rope_kv_ref
from tests.fixtures.triton_kernels import CPU_TOKENS, DEVICE, GPU_TOKENS, HAS_CUDA, import_kernel
from tests.kernels.test_qk_norm_rope_kv import make_case

E4M3 = torch.float8_e4m3fn
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def grid() -> torch.Tensor:
    """Every finite e4m3 value, ascending, from its 256 bit patterns (float64)."""
    values = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(E4M3).double()
    return values[values.isfinite()].unique()


def nearest_even(x: torch.Tensor) -> torch.Tensor:
    """Each x (float64) rounded to e4m3 by enumeration: clamped to +-448, the nearest grid value, a tie to the
    one whose code is even."""
    values = grid()
    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    dist = (x[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best  # one, or two at a tie
    codes = values.to(E4M3).view(torch.uint8).long()
    even = candidates & (codes[None, :] % 2 == 0)
    pick = torch.where(candidates.sum(1, keepdim=True) > 1, even, candidates).float().argmax(dim=1)
    return values[pick]


def test_quantize_rounds_to_nearest_even_and_saturates() -> None:
    gen = torch.Generator().manual_seed(0)
    values = grid()
    ties = (values[1:] + values[:-1]) / 2  # exactly halfway between neighbours
    x = torch.cat([ties, torch.randn(4000, generator=gen, dtype=torch.float64) * 50, torch.tensor([1e4, -600.0])])
    for scale in (1.0, 0.37):
        got = quantize_kv(x.float(), torch.tensor(scale)).double()
        torch.testing.assert_close(got, nearest_even(x.float().double() / torch.tensor(scale).double()), atol=0, rtol=0)
    assert quantize_kv(torch.tensor([1e6, -1e6]), 1.0).double().tolist() == [448.0, -448.0]  # never NaN


def test_write_and_read_round_trip() -> None:
    """A value written and read back is within e4m3's half step: 2**-4 of itself (normal codes), 2**-10 of the
    scale (subnormal ones, below 2**-6 of it)."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.full((4, 8, 2, 16), float("nan"), dtype=E4M3)
    x = torch.randn(10, 2, 16, generator=gen) * 3
    slots = torch.randperm(32, generator=gen)[:10]
    scale = torch.tensor(0.21)
    write_kv(cache, slots, x, scale)
    back = read_kv(cache.view(32, 2, 16)[slots], scale)
    assert ((back - x).abs() <= x.abs() * 2**-4 + 2**-10 * scale).all()
    assert cache.view(32, 2, 16)[[s for s in range(32) if s not in slots.tolist()]].isnan().all()
    with pytest.raises(ValueError, match="written with its scale"):
        write_kv(cache, slots, x, None)


@pytest.fixture(scope="module")
def qk():
    return import_kernel("qk_norm_rope_kv")


def fp8_case(shape, num_tokens: int, block_size: int, dtype: torch.dtype, norm: bool, seed: int) -> dict:
    """make_case's inputs over NaN e4m3 caches; v_scale small enough that a third of the values (|v| > 1.34)
    saturate."""
    case = make_case(shape, num_tokens, block_size, dtype, norm, seed)
    for name in ("k_cache", "v_cache"):
        case[name] = torch.full(case[name].shape, float("nan"), dtype=E4M3, device=DEVICE)
    return case | {"k_scale": torch.tensor(0.37, device=DEVICE), "v_scale": torch.tensor(0.003, device=DEVICE)}


def check(qk, case: dict, exact: bool) -> None:
    """The kernel and the reference on copies of the same caches: the same query rows, the same slots written,
    the same codes (`exact`), or codes at most one e4m3 step apart where a float32 rounding before them differs."""
    ref_case = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    q_ref = qk_norm_rope_kv_ref(**ref_case)
    q = qk.qk_norm_rope_kv(**case)
    if exact:
        torch.testing.assert_close(q, q_ref, atol=0, rtol=0)
    saturated = 0
    for name, scale in (("k_cache", case["k_scale"]), ("v_cache", case["v_scale"])):
        got, ref = case[name], ref_case[name]  # float8 tensors: compared as floats and bytes (portable ops)
        assert torch.equal(got.float().isnan(), ref.float().isnan()), f"{name}: slots written that should not be"
        written = ~ref.float().isnan()
        codes, ref_codes = got.view(torch.uint8)[written], ref.view(torch.uint8)[written]
        saturated += int((ref.float()[written].abs() == E4M3_MAX).sum())
        if exact:
            assert torch.equal(codes, ref_codes), f"{name}: {int((codes != ref_codes).sum())} codes differ"
        else:
            g, r = read_kv(got, scale)[written], read_kv(ref, scale)[written]
            assert ((g - r).abs() <= r.abs() * 2**-3 + 2**-9 * scale).all(), f"{name}: codes more than a step apart"
            assert (codes != ref_codes).float().mean() < 0.01, f"{name}: too many codes differ"
    assert saturated > 0, "the case should saturate some values"


@pytest.mark.parametrize(
    "shape,block_size", [((4, 2, 16), 16), ((2, 1, 24), 5), ((4, 1, 128), 5)], ids=["tiny-qwen3", "d24", "gqa4-d128"]
)
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.slow
def test_fused_write_matches_ref(qk, shape: tuple[int, int, int], block_size: int, norm: bool) -> None:
    """Without the norm the kernel's values before quantizing are torch's bit for bit, so the codes are too;
    with it, within a step where a norm's last float32 bit differs."""
    for num_tokens in CPU_TOKENS:
        check(qk, fp8_case(shape, num_tokens, block_size, torch.float32, norm, seed=num_tokens), exact=not norm)


def test_fused_write_refuses_missing_scales(qk) -> None:
    case = fp8_case((4, 2, 16), 3, 16, torch.float32, True, seed=0)
    with pytest.raises(TypeError, match="needs its v_scale"):
        qk.qk_norm_rope_kv(**dict(case, v_scale=None))
    with pytest.raises(TypeError, match="float8_e4m3fn for both"):
        qk.qk_norm_rope_kv(**dict(case, v_cache=case["v_cache"].float()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3"])
def test_gpu_fused_write_matches_ref(qk, dtype: torch.dtype, norm: bool) -> None:
    for num_tokens in GPU_TOKENS[::7]:
        # Within a step, not bit for bit: on the H200 (run 58) one key code in thousands differed by one e4m3
        # step from torch's CUDA division and cast in bf16 without the norm (query rows equal bit for bit); the
        # cause is not pinned down, and the engine's paths all write through this kernel on CUDA.
        check(qk, fp8_case((16, 8, 128), num_tokens, 16, dtype, norm, seed=num_tokens), exact=False)
