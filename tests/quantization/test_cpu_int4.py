"""Quantized weights kept packed for torch's CPU int4 kernel (quantization/cpu_int4.py) against their
dequantized float32 twin: the layer maths over odd shapes, both code widths, zero points and mins, every group
size, one token row (the kernel) and prompt chunks (dequantized to bfloat16); the LM head's requantization; and
the whole engine on tiny GGUF files, whose every prefix's log-probabilities stay within the bfloat16 bound the
GPU tests use (tests/gpu/test_quant.py) of the float32 path's (ASYNCLLM_CPU_INT4=off)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from asyncllm import LLM, SamplingParams
from asyncllm.kernels.quant_matmul_ref import dequantize_ref, pack_codes, quant_matmul_ref
from asyncllm.quantization import cpu_int4
from asyncllm.quantization.scheme import resolve_quantization
from tests.fixtures.tiny_gguf import build_hf_model, write_gguf

pytestmark = pytest.mark.skipif(not cpu_int4.supported(), reason="no native bfloat16 on this CPU")
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=64)
REL_TOL = 2e-2  # bfloat16 inputs and per-group (scale, zero): a few 2**-9 roundings a product


def _layer(n: int, k: int, bits: int, group: int, offsets: str, gen: torch.Generator) -> dict:
    groups = -(-k // group)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half()
    qzeros = torch.randint(0, 2**bits, (n, groups), generator=gen).to(torch.uint8) if offsets == "zeros" else None
    mins = (-torch.rand(n, groups, generator=gen) * 0.1).half() if offsets == "mins" else None
    return dict(qweight=pack_codes(codes, bits), scales=scales, qzeros=qzeros, mins=mins)


@pytest.mark.parametrize(("n", "k", "group"), [(64, 96, 32), (192, 320, 64), (128, 256, 128), (64, 512, 256),
                                               (128, 160, 160)])  # fmt: skip
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("offsets", ["zeros", "mins", "none"])
@pytest.mark.parametrize("rows", [1, 5, cpu_int4.INT4_MAX_ROWS + 7])
def test_packed_matmul_matches_the_dequantized_reference(n, k, group, bits, offsets, rows) -> None:
    gen = torch.Generator().manual_seed(n * k + bits + rows)
    layer = _layer(n, k, bits, group, offsets, gen)
    assert cpu_int4.packable(n, k, bits, group)
    weight = cpu_int4.pack(**layer, bits=bits, group_size=group)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    ref = quant_matmul_ref(x, **layer, bits=bits, group_size=group, bias=bias)
    got = cpu_int4.int4_linear(x, weight, bias)
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert ((got - ref).norm() / ref.norm()).item() < REL_TOL
    dense = dequantize_ref(**{k_: v for k_, v in layer.items() if k_ != "mins"}, bits=bits, group_size=group,
                           mins=layer["mins"])  # fmt: skip
    back = cpu_int4.dequantize(weight).float()
    assert ((back - dense).norm() / dense.norm()).item() < REL_TOL


def test_shapes_the_kernel_cannot_take_are_refused() -> None:
    assert not cpu_int4.packable(96, 64, 4, 32)  # outputs not in tiles of 64
    assert not cpu_int4.packable(64, 64, 8, 16)  # Q6_K's groups of 16
    assert not cpu_int4.packable(64, 64, 8, 32, fp8=True)
    assert cpu_int4.kernel_group(576, 576) == 64 and cpu_int4.kernel_group(96, 96) == 32


def test_requantized_q8_0_weights_come_back_exactly() -> None:
    """A weight llama.cpp's Q8_0 rule produced (d = amax / 127, q = round(x / d)) read back as floats requantizes
    to the same codes and scales (why a GGUF Q8_0 head packs without a loss of its own)."""
    gen = torch.Generator().manual_seed(1)
    floats = torch.randn(128, 96, generator=gen) * 0.05
    qweight, scales, qzeros = cpu_int4.requantize_int8(floats)
    stored = dequantize_ref(qweight, scales, qzeros, bits=8, group_size=32)
    again = cpu_int4.requantize_int8(stored)
    assert torch.equal(again[0], qweight) and torch.equal(again[1], scales)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpu_int4")
    model = build_hf_model("llama", vocab_size=128, intermediate_size=128, tie_word_embeddings=True)
    return {q: write_gguf(root / f"llama-{q}.gguf", "llama", model, quant=Q[q]) for q in ("Q4_1", "Q8_0", "Q4_0")}


def _logprobs(path: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, mode: str) -> list[dict]:
    monkeypatch.setenv("ASYNCLLM_CPU_INT4", mode)
    llm = LLM(str(path), **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=8, ignore_eos=True)
        return [o.logprobs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_0"])
def test_engine_logprobs_within_bf16_bound_of_the_float32_path(files, qtype, monkeypatch) -> None:
    """Every prefix of a 70-token prompt (one batch: decode rows through the kernel, prompt chunks of 64
    through the dequantized bfloat16 GEMM), its top-8 log-probabilities against the float32 path's."""
    ids = [(i * 37 + 11) % 120 + 3 for i in range(70)]
    prompts = [ids[: n + 1] for n in range(0, len(ids), 3)]
    packed = _logprobs(files[qtype], prompts, monkeypatch, "auto")
    ref = _logprobs(files[qtype], prompts, monkeypatch, "off")
    for got, want in zip(packed, ref, strict=True):
        scale = max(abs(v) for v in want.values())
        tol = 2 * (0.03 * scale + 0.05)
        shared = set(got) & set(want)
        assert shared, (got, want)
        assert max(abs(got[t] - want[t]) for t in shared) <= tol


def test_gguf_on_a_bf16_cpu_stays_quantized_head_included(files) -> None:
    from asyncllm.model_loader.checkpoint import open_checkpoint

    qc = open_checkpoint(str(files["Q4_1"]), torch.float32).hf_config.quantization_config
    assert qc["head_type"] == "Q4_1"
    scheme = resolve_quantization(None, qc, "cpu", cpu_int4=True)
    assert scheme is not None and scheme.cpu_int4 and scheme.head_type == "Q4_1"
    assert resolve_quantization(None, qc, "cpu", cpu_int4=False) is None
    assert resolve_quantization(None, qc, "cuda", cpu_int4=True).cpu_int4 is False


def test_a_tied_q8_0_table_is_kept_as_its_codes_exactly() -> None:
    """A tied embedding whose values are Q8_0's (d * q) is read from 8-bit codes and scales, every looked-up row
    the float table's bit for bit; a table those codes do not give back (plain floats) keeps its floats, and
    without `keep_codes` (an untied head) none is made."""
    from asyncllm.quantization.cpu_pack import _pack_head

    gen = torch.Generator().manual_seed(2)
    floats = torch.randn(192, 96, generator=gen) * 0.05
    qweight, scales, qzeros = cpu_int4.requantize_int8(floats)
    table = dequantize_ref(qweight, scales, qzeros, bits=8, group_size=32)  # what a GGUF Q8_0 file holds
    want = table.clone()  # the table itself is consumed: its pages go back as their codes prove exact
    packed, embedding = _pack_head(table, keep_codes=True)
    assert embedding is not None and packed.out_features == 192
    ids = torch.tensor([0, 191, 7, 7, 64])
    assert torch.equal(embedding(ids), want[ids])
    assert _pack_head(floats, keep_codes=True)[1] is None
    assert _pack_head(table, keep_codes=False)[1] is None


def test_a_table_the_codes_miss_late_is_given_back_whole() -> None:
    """The float table's rows are released slice by slice as their codes prove exact; a later slice the codes
    miss keeps the table, its released rows written back from their codes: the same values as before."""
    from asyncllm.quantization.cpu_pack import _HEAD_ROWS, _pack_head

    gen = torch.Generator().manual_seed(3)
    floats = torch.randn(2 * _HEAD_ROWS + 64, 256, generator=gen) * 0.05
    table = floats.clone()
    exact_rows = 2 * _HEAD_ROWS
    qweight, scales, qzeros = cpu_int4.requantize_int8(floats[:exact_rows])
    table[:exact_rows] = dequantize_ref(qweight, scales, qzeros, bits=8, group_size=32)
    want = table.clone()
    packed, embedding = _pack_head(table, keep_codes=True)
    assert embedding is None and packed.out_features == table.shape[0]
    assert torch.equal(table, want)
