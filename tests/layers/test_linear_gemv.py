"""A dense linear layer taking the one-launch GEMV at one token row (`Linear.use_gemv`; worker/gemm_layout.py
chooses where) equals its F.linear form: plain, packed (q/k/v), row-parallel (the GEMV's partial sums reduced
like F.linear's); more than one row keeps F.linear; turned off it is F.linear again. The GEMV runs in Triton's
interpreter here (float32) and compiled on CUDA; the kernel's own tests are tests/kernels/test_linear_gemv.py."""

from __future__ import annotations

import pytest
import torch

from asyncllm.layers.linear import Linear, PackedLinear
from asyncllm.layers.parallel import RowParallelLinear
from tests.fixtures.triton_kernels import DEVICE, TOLERANCE, import_kernel

TOL = TOLERANCE[torch.float32]


@pytest.fixture(autouse=True)
def _kernels() -> None:
    import_kernel("quant_matmul_gemv")  # the interpreter without CUDA


def _filled(layer: Linear) -> Linear:
    gen = torch.Generator().manual_seed(layer.weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / layer.weight.shape[1] ** 0.5)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    return layer.to(DEVICE)


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_through_the_gemv_equals_f_linear(bias: bool) -> None:
    layer = _filled(PackedLinear(96, {"q": 64, "k": 32, "v": 32}, bias=bias))
    xs = {m: torch.randn(m, 96, device=DEVICE) for m in (1, 3)}
    with torch.inference_mode():
        want = {m: layer(x) for m, x in xs.items()}
        layer.use_gemv(True)
        assert layer.gemv
        strided = torch.randn(1, 100, device=DEVICE)[:, :96]
        for m, x in xs.items():
            torch.testing.assert_close(layer(x), want[m], atol=TOL, rtol=TOL)
        want_strided = torch.nn.functional.linear(strided.contiguous(), layer.weight, layer.bias)
        torch.testing.assert_close(layer(strided), want_strided, atol=TOL, rtol=TOL)
        layer.use_gemv(False)
        assert not layer.gemv and torch.equal(layer(xs[1]), want[1])


def test_the_gemv_needs_the_plain_layout_and_a_float_weight() -> None:
    layer = _filled(Linear(64, 32, bias=False))
    layer.store_weight_transposed()
    with pytest.raises(ValueError, match=r"the GEMV reads \[out, in\] float weights with contiguous rows"):
        layer.use_gemv(True)
    assert not layer.gemv
    double = _filled(Linear(64, 32, bias=False))
    double.weight.data = double.weight.data.double()
    with pytest.raises(ValueError, match=r"torch\.float64"):
        double.use_gemv(True)


def test_row_parallel_layer_projects_through_the_gemv() -> None:
    """Each rank's partial sums (`project`, which `forward` all-reduces) through the GEMV equal F.linear's over
    its input columns; the ranks' partials add up to the whole layer. (Triton's interpreter runs one kernel at
    a time, so the ranks' kernels run here one after the other; tests/layers/test_parallel.py has the reduce.)"""
    world, d_in, d_out = 2, 64, 48
    full = _filled(Linear(d_in, d_out, bias=False))
    x = torch.randn(1, d_in, device=DEVICE)
    partials = []
    with torch.inference_mode():
        for rank in range(world):
            cols = slice(rank * d_in // world, (rank + 1) * d_in // world)
            local = Linear(d_in // world, d_out, bias=False).to(DEVICE)
            local.weight.copy_(full.weight[:, cols])
            layer = RowParallelLinear(local, _NoGroup(rank, world))
            assert not layer.gemv
            want = layer.project(x[:, cols].contiguous(), None)
            layer.use_gemv(True)
            partials.append(layer.project(x[:, cols].contiguous(), None))
            torch.testing.assert_close(partials[-1], want, atol=TOL, rtol=TOL)
        torch.testing.assert_close(sum(partials), full(x), atol=TOL, rtol=TOL)


class _NoGroup:
    """A rank's place in a group whose collectives this test never calls."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not called")

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not called")
