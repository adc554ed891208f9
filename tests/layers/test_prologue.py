"""A norm or SiLU-and-mul folded into the next linear layer's GEMV at one token row (layers/prologue.py) equals
the two run apart: `norm_linear` with and without the residual (the new residual returned, the caller's
tensors left as they are), `act_linear`; more than one row runs the pair apart; `fusable` refuses what the
fused launch cannot run (Gemma's norm form, an unfused norm, a LoRA-wrapped layer's stand-in). Kernels in
Triton's interpreter here (float32); their own tests are tests/kernels/test_gemv_prologue.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncllm.layers.activation import SiluAndMul
from asyncllm.layers.linear import Linear, PackedLinear
from asyncllm.layers.norm import GemmaRMSNorm, RMSNorm
from asyncllm.layers.prologue import PrologueKind, ProloguePair, act_linear, fusable, norm_linear
from tests.fixtures.triton_kernels import DEVICE, TOLERANCE, import_kernel

TOL = TOLERANCE[torch.float32]
HIDDEN, INTER = 96, 80


@pytest.fixture(autouse=True)
def _kernels() -> None:
    for name in ("quant_matmul_gemv", "rms_norm", "silu_mul"):
        import_kernel(name)  # the interpreter without CUDA


def _filled(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return module.to(DEVICE)


def _norm_pair() -> tuple[RMSNorm, PackedLinear]:
    norm = _filled(RMSNorm(HIDDEN, 1e-6), 1)
    linear = _filled(PackedLinear(HIDDEN, {"q": 64, "k": 32, "v": 32}, bias=True), 2)
    assert isinstance(norm, RMSNorm) and isinstance(linear, PackedLinear)
    norm.enable_fused_kernels()
    return norm, linear


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear_folded_equals_apart(with_residual: bool) -> None:
    norm, linear = _norm_pair()
    assert fusable(ProloguePair(PrologueKind.RMS_NORM, norm, linear))
    for rows in (1, 3):
        x = torch.randn(rows, HIDDEN, device=DEVICE) * 3
        residual = torch.randn(rows, HIDDEN, device=DEVICE) * 3 if with_residual else None
        with torch.inference_mode():
            want, want_res = norm_linear(norm, linear, x.clone(), None if residual is None else residual.clone())
            linear.use_prologue_gemv(True)
            assert linear.prologue_gemv
            kept = (x.clone(), None if residual is None else residual.clone())
            got, got_res = norm_linear(norm, linear, x, residual)
            linear.use_prologue_gemv(False)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
        torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)
        if rows == 1:  # the folded launch leaves the caller's tensors alone
            assert torch.equal(x, kept[0]) and (residual is None or torch.equal(residual, kept[1]))


def test_act_linear_folded_equals_apart() -> None:
    act = SiluAndMul()
    act.enable_fused_kernels()
    linear = _filled(Linear(INTER, HIDDEN, bias=False), 3)
    assert isinstance(linear, Linear) and fusable(ProloguePair(PrologueKind.SILU_MUL, act, linear))
    for rows in (1, 2):
        gate_up = torch.randn(rows, 2 * INTER, device=DEVICE) * 2
        with torch.inference_mode():
            want = act_linear(act, linear, gate_up)
            linear.use_prologue_gemv(True)
            got = act_linear(act, linear, gate_up)
            linear.use_prologue_gemv(False)
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_fusable_refuses_what_the_launch_cannot_run() -> None:
    norm, linear = _norm_pair()
    gemma = GemmaRMSNorm(HIDDEN, 1e-6)
    gemma.enable_fused_kernels()
    unfused = RMSNorm(HIDDEN, 1e-6)
    wrapped = nn.Sequential(linear)  # any module standing for the layer (a LoRA wrapper, a quantized layer)
    assert not fusable(ProloguePair(PrologueKind.RMS_NORM, gemma, linear))
    assert not fusable(ProloguePair(PrologueKind.RMS_NORM, unfused, linear))
    assert not fusable(ProloguePair(PrologueKind.RMS_NORM, norm, wrapped))
    assert not fusable(ProloguePair(PrologueKind.SILU_MUL, SiluAndMul(), linear))
    linear.store_weight_transposed()  # cuBLAS's [in, out] layout: the GEMV reads [out, in]
    assert not fusable(ProloguePair(PrologueKind.RMS_NORM, norm, linear))
