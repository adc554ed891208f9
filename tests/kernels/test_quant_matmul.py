"""The quantized GEMM and dequantization kernels against `quant_matmul_ref` / `dequantize_ref`, their
specification, and the specification itself against its definition.

CPU (Triton's interpreter, float32): int4 and int8 codes with and without zero points, groups of 32, 128 and
the whole row, e4m3 codes with per-channel and per-group scales, bias, split-K, strided activation rows, odd
token counts and output sizes; dequantization bit for bit. GPU (bfloat16, tests/gpu runs them): every linear
shape of the supported models (Qwen3-0.6B, Qwen3-8B and its TP=2 shards, Llama-3-8B, SmolLM2-135M) at every
CUDA-graph batch size, the layer's large-M paths (dequantize + cuBLAS, W8A8 `torch._scaled_mm`) beside them.
Tolerance: the shared table, float32 1e-5 (both sides add exact float32 products, in other orders) and
bfloat16 2e-2 (the output's rounding, and for groups smaller than a K tile the dequantized weight rounded to
bfloat16, as the 16-bit GEMM it replaces would).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncllm.kernels.quant_matmul_ref import (
    FP8_DTYPE,
    dequantize_ref,
    fp8_w8a8_matmul_ref,
    pack_codes,
    quant_matmul_ref,
    quantize_fp8_per_token,
    quantize_fp8_rows,
    unpack_codes,
)
from tests.fixtures.triton_kernels import CPU_TOKENS, DEVICE, GPU_TOKENS, HAS_CUDA, TOLERANCE, import_kernel

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# (N, K) of every linear layer: qkv, o, gate_up, down.
MODEL_SHAPES = {
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "qwen3-8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
    "qwen3-8b-tp2": [(3072, 4096), (4096, 2048), (12288, 4096), (4096, 6144)],
    "llama-3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
}


@pytest.fixture(scope="module")
def qm():
    return import_kernel("quant_matmul")


def random_weight(
    n: int, k: int, *, codes: str, group: int, zeros: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(qweight, scales, qzeros, bits) on DEVICE; codes: "int4", "int8" (float16 scales, as the layers keep
    them) or "fp8" (float32 scales). Scales spread the weights like N(0, 1/K) so outputs stay O(1) whatever K."""
    return _random_weight(n, k, codes=codes, group=group, zeros=zeros, seed=seed)[:4]


def random_mins(scales: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """Per-group offsets of the order of a group's span (GGUF Q4_1's m = the group's minimum)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return -(torch.rand(scales.shape, generator=gen, device=DEVICE) + 0.5) * scales * 2 ** (bits - 1)


def _random_weight(
    n: int, k: int, *, codes: str, group: int, zeros: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    groups = -(-k // group)
    if codes == "fp8":
        values = torch.randn(n, k, generator=gen, device=DEVICE) * 100
        qweight, bits = values.clamp(-448, 448).to(FP8_DTYPE), 8
        scales = torch.rand(n, groups, generator=gen, device=DEVICE) / (100 * k**0.5)
    else:
        bits = int(codes[3:])
        qweight = pack_codes(torch.randint(0, 2**bits, (n, k), generator=gen, device=DEVICE), bits)
        scales = ((torch.rand(n, groups, generator=gen, device=DEVICE) + 0.5) / (2**bits * k**0.5)).half()
    qzeros = torch.randint(0, 2**bits, (n, groups), generator=gen, device=DEVICE, dtype=torch.uint8) if zeros else None
    return qweight, scales, qzeros, bits


def check(qm, m: int, n: int, k: int, dtype: torch.dtype, seed: int, *, split_k: int | None = None,
          x_pad: int = 0, bias: bool = True, mins: bool = False, **weight) -> None:  # fmt: skip
    qweight, scales, qzeros, bits = random_weight(n, k, seed=seed, **weight)
    offsets = random_mins(scales, bits, seed) if mins else None
    group = weight["group"]
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    x = torch.randn(m, k + x_pad, generator=gen, device=DEVICE).to(dtype)[:, :k]  # strided rows when padded
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    got = qm.quant_matmul(
        x, qweight, scales, qzeros, bits=bits, group_size=group, bias=b, split_k=split_k, mins=offsets
    )
    want = quant_matmul_ref(x, qweight, scales, qzeros, bits=bits, group_size=group, bias=b, mins=offsets)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("codes", "group", "zeros"),
    [
        ("int4", 128, True),
        ("int4", 32, "mins"),
        ("int4", 128, "mins"),
        ("int4", 256, "mins"),
        ("int4", 32, False),
        ("int4", 256, True),
        ("int8", 32, True),
        ("int8", 128, False),
        ("fp8", 256, False),
        ("fp8", 64, False),
    ],
)
def test_matches_ref(qm, codes: str, group: int, zeros: bool) -> None:
    """Every CPU token count; 70 outputs (a partial output tile), 256 inputs; zero points, GGUF-style mins, or
    neither; groups of 128 (one per K tile: scaled after the tile's dot), 32 and 64 (several per tile), 256 (the
    whole row: scaled after the K loop); the split test's 40 covers groups that tiles cut (per element)."""
    mins = zeros == "mins"
    for m in CPU_TOKENS:
        check(qm, m, 70, 256, torch.float32, seed=m, codes=codes, group=group, zeros=zeros is True, mins=mins)


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_and_strided_rows(qm, split_k: int) -> None:
    """K split over programs (partial sums added by the launcher, bias after them); 200 inputs: a partial K
    tile; activation rows padded to a stride."""
    check(qm, 5, 64, 200, torch.float32, seed=9, split_k=split_k, x_pad=8, codes="int8", group=40, zeros=True)
    check(qm, 2, 48, 384, torch.float32, seed=10, split_k=split_k, codes="fp8", group=128, zeros=False)
    check(qm, 3, 40, 256, torch.float32, seed=11, split_k=split_k, codes="int4", group=256, zeros=False, mins=True)


@pytest.mark.parametrize(("codes", "zeros"), [("int4", True), ("int8", False), ("fp8", False), ("int4", "mins")])
def test_dequantize_is_the_reference_bit_for_bit(qm, codes: str, zeros: bool | str) -> None:
    """Bit for bit; with mins within one float32 rounding on GPU (q * s + m may fuse into one FMA there)."""
    qweight, scales, qzeros, bits = random_weight(70, 256, codes=codes, group=64, zeros=zeros is True, seed=3)
    mins = random_mins(scales, bits, 3) if zeros == "mins" else None
    got = qm.dequantize(qweight, scales, qzeros, bits=bits, group_size=64, dtype=torch.float32, mins=mins)
    want = dequantize_ref(qweight, scales, qzeros, bits=bits, group_size=64, mins=mins)
    tol = 1e-6 if mins is not None and HAS_CUDA else 0.0
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_empty_batch_and_launcher_checks(qm) -> None:
    qweight, scales, qzeros, bits = random_weight(32, 64, codes="int4", group=32, zeros=True, seed=4)
    x = torch.randn(0, 64, device=DEVICE)
    assert qm.quant_matmul(x, qweight, scales, qzeros, bits=bits, group_size=32).shape == (0, 32)
    with pytest.raises(ValueError, match=r"x must be \[M, K=64\]"):
        qm.quant_matmul(torch.randn(3, 60, device=DEVICE), qweight, scales, qzeros, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"scales must be \[N, ceil\(K / group_size\)\] = \(32, 4\)"):
        qm.quant_matmul(torch.randn(3, 64, device=DEVICE), qweight, scales, qzeros, bits=4, group_size=16)
    with pytest.raises(ValueError, match=r"qzeros must be uint8"):
        qm.quant_matmul(torch.randn(3, 64, device=DEVICE), qweight, scales, qzeros.int(), bits=4, group_size=32)
    with pytest.raises(TypeError, match=r"qweight has dtype torch.int64"):
        qm.quant_matmul(torch.randn(3, 64, device=DEVICE), qweight.long(), scales, qzeros, bits=4, group_size=32)


def test_reference_is_its_definition() -> None:
    """The packing puts code k at bits 4(k % 8) of word k // 8; the weight is (q - z) * s per group; the matmul
    is F.linear over it in float32, rounded once."""
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 0, 9, 10, 11, 12, 13, 14, 8]])
    words = pack_codes(codes, 4)
    assert words.tolist() == [[int("f7654321", 16) - 2**32, int("8edcba90", 16) - 2**32]]
    assert torch.equal(unpack_codes(words, 4), codes)
    scales, zeros = torch.tensor([[0.5, 2.0]]), torch.tensor([[8, 1]], dtype=torch.uint8)
    w = dequantize_ref(words, scales, zeros, bits=4, group_size=8)
    expected = torch.cat([(codes[0, :8] - 8) * 0.5, (codes[0, 8:] - 1) * 2.0]).float()[None]
    assert torch.equal(w, expected)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    got = quant_matmul_ref(x, words, scales, zeros, bits=4, group_size=8)
    assert torch.equal(got, F.linear(x.float(), expected).to(torch.bfloat16))


def test_fp8_quantizers() -> None:
    """Rows and tokens: the largest magnitude maps to 448 exactly; a cap on the activation scale clips."""
    w = torch.randn(5, 64) * torch.tensor([1.0, 10, 0.1, 3, 7])[:, None]
    codes, scale = quantize_fp8_rows(w)
    assert torch.equal(codes.float().abs().amax(1), torch.full((5,), 448.0))
    assert torch.allclose(codes.float() * scale, w, rtol=0.07, atol=0)
    x = torch.randn(4, 64) * 50
    xq, xs = quantize_fp8_per_token(x)
    assert torch.equal(xq.float().abs().amax(1), torch.full((4,), 448.0))
    xq, xs = quantize_fp8_per_token(x, scale_ub=1.0)
    assert torch.equal(xs, torch.full((4, 1), 1.0 / 448)) and xq.float().abs().amax() == 448
    wq, ws = quantize_fp8_rows(torch.randn(32, 64))
    y = fp8_w8a8_matmul_ref(x.bfloat16(), wq, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 32)


# GPU: bfloat16 over the models' shapes, and the layer's paths at every size it switches between.


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
@pytest.mark.parametrize(("codes", "group", "zeros"), [("int4", 128, True), ("int8", 128, False), ("fp8", -1, False)])
def test_gpu_model_shapes_every_graph_size(qm, model: str, codes: str, group: int, zeros: bool) -> None:
    """One weight per layer shape (drawn on the GPU), every CUDA-graph batch size and a few prefill sizes."""
    for n, k in MODEL_SHAPES[model]:
        g = k if group == -1 or k % group else group  # SmolLM2's 576 inputs: per-channel groups
        qweight, scales, qzeros, bits = random_weight(n, k, codes=codes, group=g, zeros=zeros, seed=n + k)
        w = dequantize_ref(qweight, scales, qzeros, bits=bits, group_size=g)  # [N, K] float32, once per shape
        for m in GPU_TOKENS:
            if m > 512 and (n, k) != MODEL_SHAPES[model][0]:
                continue  # large M once per model: the kernel's tiling does not depend on the layer
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            got = qm.quant_matmul(x, qweight, scales, qzeros, bits=bits, group_size=g)
            tol = TOLERANCE[torch.bfloat16]
            torch.testing.assert_close(got, (x.float() @ w.t()).to(torch.bfloat16), atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_16_bit_and_float32(qm, dtype: torch.dtype) -> None:
    for m in (1, 7, 64, 300):
        check(qm, m, 4096, 1024, dtype, seed=m, codes="int4", group=128, zeros=True, x_pad=8)
        check(qm, m, 1024, 2048, torch.float32, seed=m, codes="int4", group=128, zeros=True)


@pytest.mark.gpu
@needs_cuda
def test_gpu_w8a8_scaled_mm_matches_its_reference() -> None:
    """torch._scaled_mm (row-wise: per-token activations, per-channel weights) against the W8A8 reference,
    which quantizes the activations with the same function; Hopper only."""
    from asyncllm.kernels.fp8_scaled_mm import fp8_w8a8_matmul, supports_w8a8

    if not supports_w8a8(DEVICE):
        pytest.skip("row-wise scaled FP8 GEMMs need compute capability 9.0")
    for n, k in MODEL_SHAPES["qwen3-8b"] + MODEL_SHAPES["qwen3-0.6b"]:
        w, scale = quantize_fp8_rows(torch.randn(n, k, device=DEVICE) / k**0.5)
        for m in (1, 16, 64, 100, 2048):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            bias = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
            for ub in (None, 1.5):
                got = fp8_w8a8_matmul(x, w, scale.reshape(1, -1), bias=bias, scale_ub=ub)
                want = fp8_w8a8_matmul_ref(x, w, scale, bias=bias, scale_ub=ub)
                tol = TOLERANCE[torch.bfloat16]
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("codes", ["int4", "fp8"])
def test_gpu_layer_paths_agree_at_every_switch(codes: str) -> None:
    """The quantized layer with its kernels on, at token counts on both sides of each path switch (Triton
    GEMM, dequantize + cuBLAS, W8A8), against its own torch form (the reference)."""
    from asyncllm.quantization.linear import DEQUANT_MIN_TOKENS, W8A8_MIN_TOKENS, QuantLinear
    from asyncllm.quantization.scheme import CheckpointFormat, QuantScheme

    fp8 = codes == "fp8"
    scheme = QuantScheme(
        "t", CheckpointFormat.FP8 if fp8 else CheckpointFormat.AWQ, fp8=fp8, bits=8 if fp8 else 4,
        group_size=None if fp8 else 128, zero_point=not fp8, scale_dtype="float32" if fp8 else "float16",
    )  # fmt: skip
    layer = QuantLinear(4096, 2048, scheme, bias=None, device=DEVICE)
    qweight, scales, qzeros, _ = random_weight(2048, 4096, codes=codes, group=4096 if fp8 else 128, zeros=not fp8,
                                               seed=1)  # fmt: skip
    with torch.no_grad():
        layer.qweight.copy_(qweight)
        layer.scales.copy_(scales)
        if qzeros is not None:
            layer.qzeros.copy_(qzeros)
    sizes = sorted({1, W8A8_MIN_TOKENS - 1, W8A8_MIN_TOKENS, DEQUANT_MIN_TOKENS - 1, DEQUANT_MIN_TOKENS, 3000})
    xs = {m: torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16) for m in sizes}
    with torch.inference_mode():
        want = {m: layer(x) for m, x in xs.items()}
        layer.enable_fused_kernels()
        for m, x in xs.items():
            w8a8 = fp8 and m >= W8A8_MIN_TOKENS
            # W8A8 quantizes the activations too: its reference is fp8_w8a8_matmul_ref (checked above); here
            # only that it stays within e4m3's activation rounding of the weight-only result.
            tol = 0.1 if w8a8 else TOLERANCE[torch.bfloat16]
            torch.testing.assert_close(layer(x), want[m], atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="on CUDA the GPU tests compile and run the kernels themselves")
def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    """Triton's compiler (not the interpreter) builds every kernel variant for sm_90: the interpreter accepts
    kernels the compiler refuses (regression: the MODE constants were plain module globals)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("hopper_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # asyncllm as this process finds it
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.count("ok ") == 78, out.stdout
