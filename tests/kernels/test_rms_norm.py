"""The Triton RMSNorm (plain and fused with the residual add) against `rms_norm_ref`, its specification.

Hidden sizes 64/96/1000/1024/4096/5120 (96, 1000 and 5120 padded to a power of two with masks), strided rows
for x, residual and out, token counts 1, 3, 8, 17 on CPU and every CUDA-graph batch size up to 512 plus odd
ones on GPU. Outputs and residual buffers are NaN outside the data, so an unwritten element or a write past a
row fails; the residual written in place must equal `x + residual` bit for bit. CPU runs use float32 in
Triton's interpreter; 16-bit on GPU. Fresh random inputs for every check.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.rms_norm_ref import rms_norm_ref
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


@pytest.fixture(scope="module")
def rn():
    return import_kernel("rms_norm")


def random_inputs(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    """x [T, H] with strided rows, a weight near 1 (like trained norms), a strided residual."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    _, x = nan_padded((num_tokens, hidden), 5, dtype)
    x.copy_(torch.randn(num_tokens, hidden, generator=gen, device=DEVICE))
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen, device=DEVICE)).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    return x, weight, residual


def check(rn, num_tokens: int, hidden: int, dtype: torch.dtype, fused: bool, seed: int) -> None:
    """One kernel run against the reference: out (strided, NaN-poisoned), and with `fused` the residual."""
    x, weight, residual = random_inputs(num_tokens, hidden, dtype, seed)
    x_before = x.clone()
    out_buf, out = nan_padded((num_tokens, hidden), 3, dtype)
    res_buf, res = nan_padded((num_tokens, hidden), 7, dtype)
    res.copy_(residual)
    ref_res = residual.clone()
    ref = rms_norm_ref(x, weight, EPS, ref_res if fused else None)
    got = rn.rms_norm(x, weight, EPS, residual=res if fused else None, out=out)
    assert got is out
    assert not out.isnan().any(), f"{out.isnan().any(-1).sum().item()} rows were not (fully) written"
    assert_only_view_written(out_buf, hidden)
    assert_only_view_written(res_buf, hidden)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)  # x is read only
    expected_res = ref_res if fused else residual
    torch.testing.assert_close(res, expected_res, atol=0, rtol=0)  # x + residual: one rounding, as torch


@pytest.mark.parametrize("hidden", [64, 96, 1000, 1024, 4096, 5120])
def test_matches_ref(rn, hidden: int) -> None:
    """Plain and fused, every CPU token count, float32: within the shared tolerance (only the order of the
    sum of squares differs), the residual bit-exact."""
    for num_tokens in CPU_TOKENS:
        for fused in (False, True):
            check(rn, num_tokens, hidden, torch.float32, fused, seed=num_tokens + hidden + fused)


def test_rows_per_program_boundary(rn) -> None:
    """Small hidden sizes take several rows per program: token counts around that group's edges."""
    _, rows, _ = rn.launch_config(64)
    assert rows > 1
    for num_tokens in (rows - 1, rows + 1, 2 * rows + 3):
        check(rn, num_tokens, 64, torch.float32, fused=True, seed=num_tokens)


def test_out_may_be_x_and_default_allocation(rn) -> None:
    """`out=x` normalises in place; without `out` a fresh contiguous tensor comes back."""
    x, weight, residual = random_inputs(9, 96, torch.float32, seed=3)
    ref_res = residual.clone()
    ref = rms_norm_ref(x, weight, EPS, ref_res)
    assert rn.rms_norm(x, weight, EPS, residual=residual, out=x) is x
    torch.testing.assert_close(x, ref, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    torch.testing.assert_close(residual, ref_res, atol=0, rtol=0)
    y = rn.rms_norm(residual, weight, EPS)
    assert y.is_contiguous() and y.shape == residual.shape
    assert rn.rms_norm(residual[:0], weight, EPS).shape == (0, 96)  # no launch for an empty batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ref_is_the_model_norm(rn, dtype: torch.dtype) -> None:
    """The reference equals the model's RMSNorm bit for bit, and its fused form the un-fused decoder layer's
    `h = x + residual; norm(h)` (plain torch on CPU)."""
    from asyncllm.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(1000, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(1000, generator=gen))
    norm = norm.to(dtype)
    x = torch.randn(7, 1000, generator=gen).to(dtype)
    residual = torch.randn(7, 1000, generator=gen).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm_ref(x, norm.weight, EPS), norm(x), atol=0, rtol=0)
        h = x + residual
        expected = norm(h)
        got = rms_norm_ref(x, norm.weight, EPS, residual)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch.testing.assert_close(residual, h, atol=0, rtol=0)


def test_launcher_rejects_bad_inputs(rn) -> None:
    x, weight, residual = random_inputs(4, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="x must be 2-D"):
        rn.rms_norm(x[None], weight, EPS)
    with pytest.raises(TypeError, match="float64"):
        rn.rms_norm(x.double(), weight.double(), EPS)
    with pytest.raises(ValueError, match="weight shape"):
        rn.rms_norm(x, weight[:32], EPS)
    with pytest.raises(TypeError, match="residual has dtype"):
        rn.rms_norm(x, weight, EPS, residual=residual.half())
    with pytest.raises(ValueError, match="residual shape"):
        rn.rms_norm(x, weight, EPS, residual=residual[:3])
    with pytest.raises(ValueError, match="out shape"):
        rn.rms_norm(x, weight, EPS, out=torch.empty(4, 65, device=DEVICE))
    with pytest.raises(ValueError, match="stride"):
        rn.rms_norm(torch.randn(64, 4, device=DEVICE).t(), weight, EPS)
    with pytest.raises(ValueError, match="alias"):
        rn.rms_norm(x, weight, EPS, residual=residual, out=residual)


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hidden", [64, 1000, 1024, 4096, 5120])
def test_gpu_matches_ref(rn, dtype: torch.dtype, hidden: int) -> None:
    """Every CUDA-graph batch size and odd token counts, plain and fused, every dtype."""
    for num_tokens in GPU_TOKENS:
        for fused in (False, True):
            check(rn, num_tokens, hidden, dtype, fused, seed=num_tokens + hidden + fused)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay(rn) -> None:
    """Captured once, replayed over fresh inputs copied into the static buffers: graph-safe launches."""
    x, weight, residual = random_inputs(24, 1024, torch.bfloat16, seed=5)
    out = torch.empty_like(residual)
    rn.rms_norm(x, weight, EPS, residual=residual.clone(), out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rn.rms_norm(x, weight, EPS, residual=residual, out=out)
    for seed in (6, 7):
        new_x, _, new_res = random_inputs(24, 1024, torch.bfloat16, seed)
        x.copy_(new_x)
        residual.copy_(new_res)
        out.fill_(float("nan"))
        graph.replay()
        ref = rms_norm_ref(new_x, weight, EPS, new_res)
        tol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        torch.testing.assert_close(residual, new_res, atol=0, rtol=0)
