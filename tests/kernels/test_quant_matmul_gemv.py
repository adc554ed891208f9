"""The decode-sized GEMV (kernels/quant_matmul_gemv.py) against `quant_matmul_ref`, its specification.

CPU (Triton's interpreter, float32): every variant the layers send it (AWQ int4 with zero points, GPTQ int4 and
int8, GGUF Q8_0 / Q4_0 / Q4_1 in groups of 32, e4m3 with per-channel and 128-input block scales), output counts
that leave a partial row tile, K with a partial tile, K split 1-3 ways (the last program of a tile adds the
partial sums), one and several token rows, strided rows, bias, integer codes with their offsets folded
(`GemvConfig.fold_offsets`); the split counters end at zero so a layer reuses them across calls and graph
replays. GPU (bfloat16 and float16, tests/gpu runs them): the Qwen3-0.6B and 8B
layer shapes at the layer's GEMV token counts, with the split chosen for the device. Tolerance: the shared table.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.quant_matmul_ref import quant_matmul_ref
from tests.fixtures.triton_kernels import DEVICE, HAS_CUDA, TOLERANCE, import_kernel
from tests.kernels.test_quant_matmul import MODEL_SHAPES, random_mins, random_weight

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gemv():
    return import_kernel("quant_matmul_gemv")


def check(gemv, m: int, n: int, k: int, dtype: torch.dtype, seed: int, *, split_k: int | None = None,
          x_pad: int = 0, bias: bool = True, mins: bool = False, config=None, **weight) -> None:  # fmt: skip
    qweight, scales, qzeros, bits = random_weight(n, k, seed=seed, **weight)
    offsets = random_mins(scales, bits, seed) if mins else None
    group = weight["group"]
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(m, k + x_pad, generator=gen, device=DEVICE).to(dtype)[:, :k]  # strided rows when padded
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    locks = gemv.gemv_locks(n, m, DEVICE)
    for _ in range(2 if split_k and split_k > 1 else 1):  # the second call reuses the counters the first left
        got = gemv.quant_gemv(
            x,
            qweight,
            scales,
            qzeros,
            bits=bits,
            group_size=group,
            bias=b,
            split_k=split_k,
            mins=offsets,
            locks=locks,
            config=config,
        )
        assert int(locks.count_nonzero()) == 0, "the split counters must be zero again after a call"
    want = quant_matmul_ref(x, qweight, scales, qzeros, bits=bits, group_size=group, bias=b, mins=offsets)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


VARIANTS = {  # name: (codes, group, zeros: True, False or "mins")
    "awq-int4-g128": ("int4", 128, True),
    "gptq-int4-g64-sym": ("int4", 64, False),
    "gptq-int8-g128": ("int8", 128, True),
    "gguf-q8_0": ("int8", 32, True),
    "gguf-q4_0": ("int4", 32, True),
    "gguf-q4_1": ("int4", 32, "mins"),
    "int4-row-mins": ("int4", 1 << 20, "mins"),
    "fp8-channel": ("fp8", 1 << 20, False),
    "fp8-block-128": ("fp8", 128, False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_ref(gemv, variant: str) -> None:
    """70 outputs (a partial row tile); K of whole tiles and K with a partial last tile; K split 1-3 ways; one
    to three token rows; bias on the split and unsplit paths."""
    codes, group, zeros = VARIANTS[variant]
    weight = dict(codes=codes, zeros=zeros is True, mins=zeros == "mins")
    for seed, (m, k, split_k) in enumerate([(1, 512, 2), (3, 392, 3), (2, 136, 1)]):
        g = min(group, k)  # a group over the whole row where the variant has one
        check(gemv, m, 70, k, torch.float32, seed=seed, split_k=split_k, bias=seed % 2 == 0, group=g, **weight)


@pytest.mark.parametrize("variant", sorted(v for v, (codes, _, _) in VARIANTS.items() if codes != "fp8"))
def test_folded_offsets_match_ref(gemv, variant: str) -> None:
    """Integer codes multiplied in as 1 + code / 2**bits, the offsets taken off once a word
    (`GemvConfig.fold_offsets`): zero points, mins, a partial K tile, a split."""
    codes, group, zeros = VARIANTS[variant]
    weight = dict(codes=codes, zeros=zeros is True, mins=zeros == "mins")
    config = gemv.GemvConfig(block_n=64, fold_offsets=True)
    check(gemv, 2, 70, 392, torch.float32, seed=11, split_k=2, group=min(group, 392), config=config, **weight)


def test_strided_rows_and_split_choice(gemv) -> None:
    """Activation rows padded to a stride; the launcher's own split choice (one program per SM here)."""
    check(gemv, 2, 64, 256, torch.float32, seed=7, x_pad=8, codes="int4", group=128, zeros=True)
    plan = gemv.gemv_plan(1, 1024, 3072, 4, 128, 132)
    assert (
        plan is not None and plan.split * plan.tiles_per_split >= 3072 // 256 > (plan.split - 1) * plan.tiles_per_split
    )


def test_groups_the_tiles_cannot_fit_are_refused(gemv) -> None:
    """Groups of 40 neither cover nor divide a K tile: no plan, and a clear error (the layer takes the GEMM)."""
    assert gemv.gemv_plan(1, 64, 200, 8, 40, 1) is None
    qweight, scales, qzeros, bits = random_weight(64, 200, codes="int8", group=40, zeros=True, seed=1)
    with pytest.raises(ValueError, match="group_size=40 neither covers nor divides"):
        gemv.quant_gemv(torch.randn(1, 200, device=DEVICE), qweight, scales, qzeros, bits=bits, group_size=40)
    with pytest.raises(ValueError, match=r"locks must be int32 with at least \d+ counters"):
        gemv.quant_gemv(torch.randn(3, 200, device=DEVICE), *random_weight(64, 200, codes="int8", group=8,
                        zeros=True, seed=1)[:3], bits=8, group_size=8, split_k=2,
                        locks=torch.zeros(2, dtype=torch.int32, device=DEVICE))  # fmt: skip


def test_layer_takes_the_gemv_at_decode_sizes() -> None:
    """The quantized layer with its kernels on, at GEMV token counts and just past them, equals its torch form."""
    import_kernel("quant_matmul_gemv")
    from asyncllm.quantization.linear import GEMV_MAX_TOKENS, QuantLinear
    from asyncllm.quantization.scheme import CheckpointFormat, QuantScheme

    scheme = QuantScheme("awq", CheckpointFormat.AWQ, fp8=False, bits=4, group_size=32, zero_point=True)
    layer = QuantLinear(256, 48, scheme, bias=None, device=DEVICE)
    layer.fill_random(torch.Generator(device=DEVICE).manual_seed(0), 0.05)
    xs = {m: torch.randn(m, 256, device=DEVICE) for m in (1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1)}
    with torch.inference_mode():
        want = {m: layer(x) for m, x in xs.items()}
        layer.enable_fused_kernels()
        for m, x in xs.items():
            tol = TOLERANCE[torch.float32]
            torch.testing.assert_close(layer(x), want[m], atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", ["awq-int4-g128", "gguf-q4_1", "gptq-int8-g128", "fp8-channel", "fp8-block-128"])
def test_gpu_model_shapes(gemv, dtype: torch.dtype, variant: str) -> None:
    codes, group, zeros = VARIANTS[variant]
    for n, k in MODEL_SHAPES["qwen3-0.6b"] + MODEL_SHAPES["qwen3-8b"]:
        for m in (1, 2, 4):
            check(gemv, m, n, k, dtype, seed=n + k + m, codes=codes, group=min(group, k), zeros=zeros is True,
                  mins=zeros == "mins")  # fmt: skip
        if codes != "fp8":  # the folded unpacking the sweep may pick
            check(gemv, 1, n, k, dtype, seed=n + k, codes=codes, group=min(group, k), zeros=zeros is True,
                  mins=zeros == "mins", config=gemv.GemvConfig(fold_offsets=True))  # fmt: skip
