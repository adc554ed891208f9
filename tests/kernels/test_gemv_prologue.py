"""The GEMV with a prologue (`rms_norm_gemv`, `silu_mul_gemv`, kernels/quant_matmul_gemv.py) against its
specification (kernels/gemv_prologue_ref.py): RMSNorm, the residual add then RMSNorm (the new residual returned,
the inputs untouched), and silu(gate) * up folded into the linear layer after them.

CPU (Triton's interpreter, float32): odd sizes (a partial row tile, a partial K tile, K split 1-3 ways, two
rows, bias, strided rows); then every pair of the supported models (norm -> qkv, add + norm -> gate_up,
silu_mul -> down) at the split the H200 runs that layer with, over its first output tile. GPU (bfloat16,
float16): every pair at one and two rows with the launcher's own config; launched as programmatic dependents
(PDL, Hopper), with and without the weights asked of L2 before the wait: the plain launches' bits, in a chain
of dependent launches replayed from a CUDA graph too. Tolerance: the shared table.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import gemv_plan as plans
from asyncllm.kernels.gemv_prologue_ref import rms_norm_gemv_ref, silu_mul_gemv_ref
from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_kernel
from tests.kernels.test_quant_matmul import MODEL_SHAPES

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
H200_SMS = 132
EPS = 1e-6
PROLOGUES = ("rms_norm", "add_rms_norm", "silu_mul")


@pytest.fixture(scope="module")
def gemv():
    return import_kernel("quant_matmul_gemv")


def check(gemv, prologue: str, m: int, n: int, k: int, dtype: torch.dtype, seed: int, *, split_k: int | None = None,
          x_pad: int = 0, bias: bool = False, config: plans.GemvConfig | None = None) -> None:  # fmt: skip
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)

    weight = randn(n, k, scale=k**-0.5)
    b = randn(n) if bias else None
    locks = gemv.gemv_locks(n, m, DEVICE)
    kwargs = dict(locks=locks, config=config, split_k=split_k)
    if prologue == "silu_mul":
        x = randn(m, 2 * k + x_pad, scale=2.0)[:, : 2 * k]  # strided rows when padded
        got, h, want, want_h = gemv.silu_mul_gemv(x, weight, b, **kwargs), None, silu_mul_gemv_ref(x, weight, b), None
    else:
        x = randn(m, k + x_pad, scale=3.0)[:, :k]
        norm_weight = randn(k) + 1
        residual = randn(m, k, scale=3.0) if prologue == "add_rms_norm" else None
        before = (x.clone(), None if residual is None else residual.clone())
        got, h = gemv.rms_norm_gemv(x, norm_weight, EPS, weight, b, residual=residual, **kwargs)
        want, want_h = rms_norm_gemv_ref(x, norm_weight, EPS, weight, b, residual=residual)
        assert torch.equal(x, before[0]) and (residual is None or torch.equal(residual, before[1])), "inputs kept"
    assert int(locks.count_nonzero()) == 0, "the split counters must be zero again after a call"
    assert got.shape == (m, n) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if want_h is None:
        assert h is None
    else:
        torch.testing.assert_close(h, want_h, atol=0, rtol=0)  # one rounding of the same sum


@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize(("m", "k", "split_k", "bias"), [(1, 520, 3, True), (2, 136, 1, False), (1, 1100, 2, False)])
def test_matches_reference(gemv, prologue: str, m: int, k: int, split_k: int, bias: bool) -> None:
    """70 outputs (a partial row tile); K of whole and partial tiles, past one rms pass (1024); strided rows."""
    config = plans.GemvConfig(block_n=64)
    check(gemv, prologue, m, 70, k, torch.float32, seed=m + k, split_k=split_k, x_pad=8 * (m - 1), bias=bias,
          config=config)  # fmt: skip


def _pairs() -> list[tuple[str, int, int]]:
    """(prologue, N, K) of every fusable pair of the supported models' layers: [qkv, o, gate_up, down]."""
    pairs = set()
    for qkv, _o, gate_up, down in MODEL_SHAPES.values():
        pairs |= {("rms_norm", *qkv), ("add_rms_norm", *gate_up), ("silu_mul", *down)}
    return sorted(pairs)


@pytest.mark.parametrize("pair", _pairs(), ids=lambda p: "{}-{}x{}".format(*p))
@pytest.mark.slow
def test_every_model_pair_at_the_h200_split(gemv, pair: tuple[str, int, int]) -> None:
    """Each pair at the K split the H200 runs its bfloat16 layer with, on the same K tiles in float32 (twice
    the bytes a row), over the first tile of output rows."""
    prologue, n, k = pair
    config = plans.config_for(plans.FLOAT16, n, k)
    plan = plans.gemv_plan(1, n, k, plans.FLOAT16, k, H200_SMS, config=config)
    assert plan is not None
    mirrored = plans.GemvConfig(block_n=config.block_n, row_bytes=2 * config.row_bytes)
    check(gemv, prologue, 1, min(n, config.block_n), k, torch.float32, seed=n + k, split_k=plan.split,
          config=mirrored)  # fmt: skip


def test_launcher_checks(gemv) -> None:
    w = torch.randn(48, 64, device=DEVICE)
    x = torch.randn(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"norm_weight must be a contiguous \[K=64\]"):
        gemv.rms_norm_gemv(x, torch.randn(63, device=DEVICE), EPS, w)
    with pytest.raises(ValueError, match=r"residual must be \[M, K\] = \(1, 64\)"):
        gemv.rms_norm_gemv(x, torch.randn(64, device=DEVICE), EPS, w, residual=torch.randn(2, 64, device=DEVICE))
    with pytest.raises(TypeError, match=r"weight has dtype torch\.float16 and x torch\.float32"):
        gemv.rms_norm_gemv(x, torch.randn(64, device=DEVICE), EPS, w.half())
    with pytest.raises(ValueError, match=r"x must be \[M, 2 K\] = \[M, 128\] \(\[gate \| up\]\)"):
        gemv.silu_mul_gemv(x, w)
    empty = gemv.rms_norm_gemv(x[:0], torch.randn(64, device=DEVICE), EPS, w, residual=x[:0])
    assert empty[0].shape == (0, 48) and empty[1] is not None and empty[1].shape == (0, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_model_pairs(gemv, dtype: torch.dtype) -> None:
    for prologue, n, k in _pairs():
        for m in (1, 2):
            check(gemv, prologue, m, n, k, dtype, seed=n + k + m, bias=m == 2)


def _chain(gemv, rms_norm, w: dict[str, torch.Tensor], x: torch.Tensor, pdl: bool, prefetch: bool) -> torch.Tensor:
    """A decoder layer's one-row GEMVs as the engine launches them, each reading the one before's output:
    RMSNorm -> o_proj (plain GEMV) -> add + RMSNorm + gate/up -> SiLU-and-mul + down, every launch a
    programmatic dependent when `pdl` (the counters preallocated: no fill kernel between the launches)."""
    locks = w["locks"]
    normed = rms_norm(x, w["norm"], EPS, pdl=pdl)
    o = gemv.linear_gemv(normed, w["o"], locks=locks, pdl=pdl, prefetch=prefetch)
    gate_up, _ = gemv.rms_norm_gemv(o, w["norm"], EPS, w["gate_up"], residual=x, locks=locks, pdl=pdl,
                                    prefetch=prefetch)  # fmt: skip
    return gemv.silu_mul_gemv(gate_up, w["down"], locks=locks, pdl=pdl, prefetch=prefetch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hidden", [1024, 1000], ids=["0.6B", "odd"])
def test_gpu_pdl_chain_and_its_prefetch_change_no_bit(gemv, hidden: int) -> None:
    """Programmatic dependents that each read the previous kernel's output, eager and replayed from a CUDA
    graph, with and without each GEMV asking L2 for its weights before it waits: the plain launches' bits. A
    kernel that read before its wait would see the inputs of the replay before (the graph's inputs change
    between replays). `hidden` 1000: partial row tiles and K tiles on every GEMV."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs Hopper or newer")
    rms_norm = import_kernel("rms_norm").rms_norm
    gen = torch.Generator(device=DEVICE).manual_seed(hidden)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).bfloat16()

    inter = 3 * hidden
    w = {"norm": randn(hidden) + 1, "o": randn(hidden, hidden, scale=hidden**-0.5),
         "gate_up": randn(2 * inter, hidden, scale=hidden**-0.5), "down": randn(hidden, inter, scale=inter**-0.5),
         "locks": gemv.gemv_locks(2 * inter, 1, DEVICE)}  # fmt: skip
    inputs = [randn(1, hidden, scale=2.0) for _ in range(4)]
    want = [_chain(gemv, rms_norm, w, x, pdl=False, prefetch=False) for x in inputs]
    for prefetch in (True, False):
        got = [_chain(gemv, rms_norm, w, x, pdl=True, prefetch=prefetch) for x in inputs]
        assert all(torch.equal(g, e) for g, e in zip(got, want)), f"eager, prefetch={prefetch}"
        static = inputs[0].clone()
        _chain(gemv, rms_norm, w, static, pdl=True, prefetch=prefetch)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(gemv, rms_norm, w, static, pdl=True, prefetch=prefetch)
        for x, expected in zip(inputs, want):
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, expected), f"graph replay, prefetch={prefetch}"
    assert int(w["locks"].count_nonzero()) == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_one_split_without_counters_compiles() -> None:
    """A one-split launch given no `locks` (a caller outside the layers): the launcher passes an int32
    placeholder. It once passed the weight, and the compiler, which types the counters' atomics whatever the
    split, refused a bf16 weight (the interpreter does not type atomics)."""
    gemv = import_kernel("quant_matmul_gemv")
    x, weight = torch.randn(1, 256, device=DEVICE).bfloat16(), torch.randn(64, 256, device=DEVICE).bfloat16()
    got = gemv.linear_gemv(x, weight, split_k=1)
    torch.testing.assert_close(got.float(), x.float() @ weight.float().T, atol=2e-2, rtol=2e-2)


def _launch(gemv, prologue: str, x, weight, norm_weight, residual, locks, **kwargs: bool) -> torch.Tensor:
    if prologue == "silu_mul":
        return gemv.silu_mul_gemv(x, weight, locks=locks, **kwargs)
    if prologue == "none":
        return gemv.linear_gemv(x, weight, locks=locks, **kwargs)
    res = residual if prologue == "add_rms_norm" else None
    return gemv.rms_norm_gemv(x, norm_weight, EPS, weight, residual=res, locks=locks, **kwargs)[0]


@pytest.mark.gpu
@needs_cuda
def test_gpu_pdl_and_its_prefetch_change_no_bit_at_any_model_shape(gemv) -> None:
    """Every pair and o_proj of the supported models, at one and two rows, launched as a programmatic dependent
    with and without the prefetch: the plain launch's bits (the wait and the hint move no arithmetic; the
    chain above tests the ordering)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs Hopper or newer")
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    o_shapes = sorted({o for _qkv, o, _gate_up, _down in MODEL_SHAPES.values()})
    for prologue, n, k in [*_pairs(), *(("none", n, k) for n, k in o_shapes)]:
        weight = (torch.randn(n, k, generator=gen, device=DEVICE) * k**-0.5).bfloat16()
        norm_weight = (torch.randn(k, generator=gen, device=DEVICE) + 1).bfloat16()
        for m in (1, 2):
            width = 2 * k if prologue == "silu_mul" else k
            x = (torch.randn(m, width, generator=gen, device=DEVICE) * 2).bfloat16()
            residual = torch.randn(m, k, generator=gen, device=DEVICE).bfloat16()
            args = (gemv, prologue, x, weight, norm_weight, residual, gemv.gemv_locks(n, m, DEVICE))
            plain = _launch(*args)
            for prefetch in (True, False):
                assert torch.equal(_launch(*args, pdl=True, prefetch=prefetch), plain), (prologue, n, k, m, prefetch)
