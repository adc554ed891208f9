"""Gemma's forms of the fused kernels against their specifications, and those against transformers' Gemma 3.

The (1 + w) RMSNorm (`rms_norm(unit_offset=True)`, plain and fused with the residual add, against
`gemma_rms_norm_ref`), the fused q/k norm + rotary + KV store in that form, and the GELU-tanh gate
(`gelu_tanh_and_mul` against `gelu_tanh_and_mul_ref`), through the same checks as their Llama forms (strided,
NaN-poisoned buffers; odd sizes; float32 in the interpreter on CPU, 16-bit on GPU). The references are then
held to transformers' own modules bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.qk_norm_rope_kv_ref import qk_norm_rope_kv_ref
from asyncllm.kernels.rms_norm_ref import gemma_rms_norm_ref
from asyncllm.kernels.silu_mul_ref import gelu_tanh_and_mul_ref
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
from tests.kernels.test_qk_norm_rope_kv import assert_matches, make_case

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
EPS = 1e-6


def _check_norm(rn, num_tokens: int, hidden: int, dtype: torch.dtype, fused: bool, seed: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    _, x = nan_padded((num_tokens, hidden), 5, dtype)
    x.copy_(torch.randn(num_tokens, hidden, generator=gen, device=DEVICE))
    weight = (0.5 * torch.randn(hidden, generator=gen, device=DEVICE)).to(dtype)  # zero-centred, as Gemma's
    out_buf, out = nan_padded((num_tokens, hidden), 3, dtype)
    res_buf, res = nan_padded((num_tokens, hidden), 7, dtype)
    res.copy_(torch.randn(num_tokens, hidden, generator=gen, device=DEVICE))
    ref_res = res.clone()
    ref = gemma_rms_norm_ref(x, weight, EPS, ref_res if fused else None)
    assert rn.rms_norm(x, weight, EPS, residual=res if fused else None, out=out, unit_offset=True) is out
    assert not out.isnan().any()
    assert_only_view_written(out_buf, hidden)
    assert_only_view_written(res_buf, hidden)
    torch.testing.assert_close(out, ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)


def _check_gelu(sm, num_tokens: int, inter: int, dtype: torch.dtype, seed: int, tail: float) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    _, x = nan_padded((num_tokens, 2 * inter), 6, dtype)
    x.copy_(3 * torch.randn(num_tokens, 2 * inter, generator=gen, device=DEVICE))
    x[:, 0], x[:, inter - 1] = -tail, tail  # the tanh's saturated ends
    out_buf, out = nan_padded((num_tokens, inter), 2, dtype)
    assert sm.gelu_tanh_and_mul(x, out=out) is out
    assert not out.isnan().any()
    assert_only_view_written(out_buf, inter)
    torch.testing.assert_close(out, gelu_tanh_and_mul_ref(x), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("hidden", [64, 96, 2560])
def test_gemma_rms_norm_matches_ref(hidden: int) -> None:
    rn = import_kernel("rms_norm")
    for num_tokens in CPU_TOKENS:
        for fused in (False, True):
            _check_norm(rn, num_tokens, hidden, torch.float32, fused, seed=num_tokens + hidden + fused)


@pytest.mark.parametrize("inter", [100, 128, 10240])
def test_gelu_tanh_and_mul_matches_ref(inter: int) -> None:
    sm = import_kernel("silu_mul")
    for num_tokens in CPU_TOKENS:
        _check_gelu(sm, num_tokens, inter, torch.float32, seed=num_tokens + inter, tail=1e4)


@pytest.mark.parametrize("shape,block_size", [((4, 2, 16), 16), ((2, 1, 24), 5), ((8, 4, 256), 16)])
def test_gemma_qk_norm_rope_kv_matches_ref(shape: tuple[int, int, int], block_size: int) -> None:
    qk = import_kernel("qk_norm_rope_kv")
    for num_tokens in CPU_TOKENS[:3]:
        case = make_case(shape, num_tokens, block_size, torch.float32, norm=True, seed=num_tokens)
        for name in ("q_norm_weight", "k_norm_weight"):
            case[name] = case[name] - 1  # zero-centred, as Gemma's
        ref_case = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
        q_ref = qk_norm_rope_kv_ref(**ref_case, unit_offset=True)
        q_out = qk.qk_norm_rope_kv(**case, unit_offset=True)
        assert_matches(case, q_out, ref_case, q_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_references_are_transformers_gemma3(dtype: torch.dtype) -> None:
    """gemma_rms_norm_ref is Gemma3RMSNorm, gelu_tanh_and_mul_ref is Gemma3MLP's gate, bit for bit."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(7, 48, generator=gen)).to(dtype)
    norm = Gemma3RMSNorm(48, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.randn(48, generator=gen))
        norm = norm.to(dtype)
        torch.testing.assert_close(gemma_rms_norm_ref(x, norm.weight, EPS), norm(x), atol=0, rtol=0)
        gate, up = x.chunk(2, dim=-1)
        expected = ACT2FN["gelu_pytorch_tanh"](gate) * up
        torch.testing.assert_close(gelu_tanh_and_mul_ref(x), expected, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_gemma_forms_match_ref(dtype: torch.dtype) -> None:
    rn, sm, qk = import_kernel("rms_norm"), import_kernel("silu_mul"), import_kernel("qk_norm_rope_kv")
    for num_tokens in GPU_TOKENS:
        for hidden in (1152, 2560):
            _check_norm(rn, num_tokens, hidden, dtype, fused=num_tokens % 2 == 0, seed=num_tokens + hidden)
        _check_gelu(sm, num_tokens, 10240, dtype, seed=num_tokens, tail=1e4)
    for num_tokens in (1, 17, 256):
        case = make_case((8, 4, 256), num_tokens, 16, dtype, norm=True, seed=num_tokens)
        for name in ("q_norm_weight", "k_norm_weight"):
            case[name] = case[name] - 1
        ref_case = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
        q_ref = qk_norm_rope_kv_ref(**ref_case, unit_offset=True)
        assert_matches(case, qk.qk_norm_rope_kv(**case, unit_offset=True), ref_case, q_ref)
