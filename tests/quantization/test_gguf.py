"""GGUF files kept quantized: Q8_0, Q4_0 and Q4_1 linear layers repacked at load into the quantized layout,
dequantizing to exactly the weights the dequantizing reader gives (llama.cpp's Q/K row order undone on codes,
scales and offsets alike); the engine's tokens equal the dequantized path's; the choice of path by device
and argument; SmolLM2's real Q4_1 file (when installed): same weights, same perplexity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from asyncllm import LLM, SamplingParams
from asyncllm.errors import UnsupportedModelError
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.quantization.scheme import resolve_quantization
from tests.fixtures.tiny_gguf import build_hf_model, write_gguf
from tests.quantization.helpers import dequantized_weights, load_quantized

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("gguf")

    class _Lazy(dict):
        def __missing__(self, key: tuple[str, str]) -> Path:
            family, qtype = key
            path = write_gguf(root / f"{family}-{qtype}.gguf", family, build_hf_model(family), quant=Q[qtype])
            self[key] = path
            return path

    return _Lazy()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kept_quantized_weights_equal_the_dequantized_reader(tiny_files, family: str, qtype: str) -> None:
    path = tiny_files[(family, qtype)]
    floats = dict(open_checkpoint(str(path), torch.float32).iter_weights())
    got = dequantized_weights(load_quantized(path, "gguf"))
    assert len(got) == 7 * 2
    for name, weight in got.items():
        assert torch.equal(weight, floats[name]), name


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_engine_tokens_equal_the_dequantized_path(tiny_files, qtype: str) -> None:
    path = tiny_files[("llama", qtype)]
    prompts = [[5, 9, 2, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for quantization in ("gguf", None):  # None on CPU: dequantized at load
        llm = LLM(str(path), quantization=quantization, **ENGINE)
        outs[quantization] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs["gguf"] == outs[None]


def test_which_path_by_device_and_argument(tiny_files, tmp_path: Path) -> None:
    """On CUDA a supported file stays quantized unless asked otherwise; on CPU it is dequantized unless
    asked; a file whose types are not kept is dequantized, and refused only when "gguf" is asked for (files
    mixing types: test_gguf_kquants.py)."""
    qc = open_checkpoint(str(tiny_files[("llama", "Q4_1")]), torch.float32).hf_config.quantization_config
    assert qc["linear_types"] == ["Q4_1"] and len(qc["module_types"]) == 7 * 2
    assert resolve_quantization(None, qc, "cuda").describe() == "gguf Q4_1: int4, 32 inputs per scale, mins"
    assert resolve_quantization(None, qc, "cpu") is None
    assert resolve_quantization("gguf", qc, "cpu") is not None
    assert resolve_quantization("fp8", qc, "cuda").fp8
    with pytest.raises(UnsupportedModelError, match=r"quantization='awq', but the checkpoint is a GGUF file"):
        resolve_quantization("awq", qc, "cuda")
    mixed = {"quant_method": "gguf", "linear_types": ["Q2_K", "Q3_K"]}
    assert resolve_quantization(None, mixed, "cuda") is None
    with pytest.raises(UnsupportedModelError, match=r"linear layers are Q2_K, Q3_K; kept quantized are .* Q8_0"):
        resolve_quantization("gguf", mixed, "cuda")


def _smollm2() -> Path:
    from asyncllm.default_model import DefaultModelMissingError, default_model_path

    try:
        return default_model_path()
    except DefaultModelMissingError:
        pytest.skip("SmolLM2's GGUF is not installed (asyncllm fetch-model)")


@pytest.mark.slow
def test_smollm2_q4_1_kept_quantized_same_weights_and_perplexity() -> None:
    """The real file: every Q4_1 linear layer repacked equals its dequantized tensor, and the perplexity of a
    fixed text through the model is the dequantized path's (float32: the same weights, within 1e-4)."""
    from tests.models.helpers import run_schedule

    path = _smollm2()
    ckpt = open_checkpoint(str(path), torch.float32)
    floats = dict(ckpt.iter_weights())
    quantized = load_quantized(path, "gguf")
    for name, weight in dequantized_weights(quantized).items():
        assert torch.equal(weight, floats[name]), name
    dequantized = load_quantized(path, None)  # no scheme asked, CPU-style: dequantized
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Tokyo of Japan."
    ids = torch.tensor(ckpt.tokenizer(text).input_ids)

    def perplexity(model) -> float:
        logits = run_schedule(model, {0: ids}, [[(0, len(ids))]], block_size=16)[0]
        return torch.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[1:])).item()

    ours, ref = perplexity(quantized), perplexity(dequantized)
    assert abs(ours - ref) <= 1e-4 * ref, (ours, ref)
