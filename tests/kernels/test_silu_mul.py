"""The Triton SiLU-and-multiply against `silu_and_mul_ref`, its specification.

Intermediate sizes 100 (padded with masks), 128, 3072 and 12288 (several programs per row), strided input and
output rows, gate values far into both tails (exp overflow gives -0, as in torch), token counts 1, 3, 8, 17 on
CPU and every CUDA-graph batch size up to 512 plus odd ones on GPU. Outputs are NaN-poisoned buffers, so an
unwritten element or a write past a row fails. CPU runs use float32 in Triton's interpreter; 16-bit on GPU.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.silu_mul_ref import silu_and_mul_ref
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


@pytest.fixture(scope="module")
def sm():
    return import_kernel("silu_mul")


def random_input(num_tokens: int, inter: int, dtype: torch.dtype, seed: int, tail: float) -> torch.Tensor:
    """[T, 2I] with strided rows, spread like MLP activations, plus gates of +-tail (the exp's far ends)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    _, x = nan_padded((num_tokens, 2 * inter), 6, dtype)
    x.copy_(3 * torch.randn(num_tokens, 2 * inter, generator=gen, device=DEVICE))
    x[:, 0], x[:, inter - 1] = -tail, tail
    return x


def check(sm, num_tokens: int, inter: int, dtype: torch.dtype, seed: int, tail: float = 80.0) -> None:
    x = random_input(num_tokens, inter, dtype, seed, tail)
    x_before = x.clone()
    out_buf, out = nan_padded((num_tokens, inter), 2, dtype)
    assert sm.silu_and_mul(x, out=out) is out
    assert not out.isnan().any(), f"{out.isnan().any(-1).sum().item()} rows were not (fully) written"
    assert_only_view_written(out_buf, inter)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=tol, rtol=tol)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)


@pytest.mark.parametrize("inter", [100, 128, 3072, 12288])
def test_matches_ref(sm, inter: int) -> None:
    """Every CPU token count, float32, within the shared tolerance (exp and its rounding differ slightly).
    Gates stay within +-80 here: the interpreter's numpy warns when exp overflows (the GPU test goes further)."""
    for num_tokens in CPU_TOKENS:
        check(sm, num_tokens, inter, torch.float32, seed=num_tokens + inter)


def test_default_allocation_and_empty(sm) -> None:
    """Without `out` a fresh contiguous [T, I] comes back; an empty batch launches nothing."""
    x = random_input(5, 100, torch.float32, seed=1, tail=10.0)
    y = sm.silu_and_mul(x)
    assert y.is_contiguous() and y.shape == (5, 100)
    torch.testing.assert_close(y, silu_and_mul_ref(x), atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    assert sm.silu_and_mul(x[:0]).shape == (0, 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ref_is_the_model_activation(sm, dtype: torch.dtype) -> None:
    """The reference equals the model's SiluAndMul bit for bit (plain torch on CPU)."""
    from asyncllm.layers.activation import SiluAndMul

    x = torch.randn(7, 2 * 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    torch.testing.assert_close(silu_and_mul_ref(x), SiluAndMul()(x), atol=0, rtol=0)


def test_launcher_rejects_bad_inputs(sm) -> None:
    x = random_input(4, 64, torch.float32, seed=2, tail=1.0)
    with pytest.raises(ValueError, match="even last dim"):
        sm.silu_and_mul(x[:, :127])
    with pytest.raises(ValueError, match="2-D"):
        sm.silu_and_mul(x[None])
    with pytest.raises(TypeError, match="float64"):
        sm.silu_and_mul(x.double())
    with pytest.raises(ValueError, match="stride"):
        sm.silu_and_mul(torch.randn(128, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match=r"out shape \(4, 128\)"):
        sm.silu_and_mul(x, out=torch.empty(4, 128, device=DEVICE))
    with pytest.raises(TypeError, match="out has dtype"):
        sm.silu_and_mul(x, out=torch.empty(4, 64, device=DEVICE, dtype=torch.float16))


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("inter", [100, 128, 3072, 12288])
def test_gpu_matches_ref(sm, dtype: torch.dtype, inter: int) -> None:
    """Every CUDA-graph batch size and odd token counts, every dtype; gates of +-100 overflow exp."""
    for num_tokens in GPU_TOKENS:
        check(sm, num_tokens, inter, dtype, seed=num_tokens + inter, tail=100.0)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_replay(sm) -> None:
    """Captured once, replayed over fresh inputs copied into the static buffer: graph-safe launches."""
    x = random_input(16, 3072, torch.bfloat16, seed=3, tail=5.0)
    out = sm.silu_and_mul(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sm.silu_and_mul(x, out=out)
    for seed in (4, 5):
        x.copy_(random_input(16, 3072, torch.bfloat16, seed, tail=5.0))
        out.fill_(float("nan"))
        graph.replay()
        tol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out, silu_and_mul_ref(x), atol=tol, rtol=tol)
