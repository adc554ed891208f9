"""The whole engine on quantized checkpoints (CPU, float32): greedy tokens equal transformers' on the same
weights dequantized, for every format; the Triton kernels (interpreter) equal the torch reference path;
tensor parallelism equals one rank; `quantization="fp8"` at load equals transformers on the e4m3 weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import InvalidConfigError
from tests.fixtures.triton_kernels import HAS_CUDA

MAX_NEW = 8
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=24)


def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 6, 19, 30)]


def _ours(path: Path, prompts: list[list[int]], max_tokens: int = MAX_NEW, **engine_args) -> list[list[int]]:
    llm = LLM(str(path), **{**ENGINE, **engine_args})
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    finally:
        llm.shutdown()
    return [o.token_ids for o in outs]


def _transformers(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


@pytest.mark.parametrize(
    "variant", ["awq", "gptq", "gptq-asym-g32", "gptq-int8", "fp8-channel", "fp8-tensor", "fbgemm", "fp8-block"]
)
def test_greedy_equals_transformers_on_dequantized_weights(variant: str, quantized_checkpoints) -> None:
    """Chunked prefill (24 tokens a step) and batched decode over the quantized layers' reference path."""
    path, dequantized, _ = quantized_checkpoints[variant]
    prompts = _prompts(384)
    assert _ours(path, prompts) == _transformers(dequantized, prompts)


def test_fp8_block_checkpoint_equals_transformers_reading_it(quantized_checkpoints) -> None:
    """transformers reads the "fp8" block-scaled checkpoint itself (dequantizing it on CPU): an independent
    reading of the format gives the same tokens."""
    path, _, _ = quantized_checkpoints["fp8-block"]
    prompts = _prompts(384, seed=4)
    assert _ours(path, prompts) == _transformers(path, prompts)


def test_fp8_at_load_equals_transformers_on_e4m3_weights(tiny_checkpoints, tmp_path: Path) -> None:
    """quantization="fp8" on a float checkpoint against transformers on that checkpoint's weights rounded
    through `quantize_fp8_rows` (the specification: one scale per output channel)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from asyncllm.kernels.quant_matmul_ref import quantize_fp8_rows
    from tests.fixtures.quantized import is_linear

    source = tiny_checkpoints["qwen3"]
    rounded = tmp_path / "rounded"
    shutil.copytree(source, rounded)
    tensors = load_file(str(source / "model.safetensors"))
    for name, w in tensors.items():
        if is_linear(name):
            codes, scale = quantize_fp8_rows(w)
            tensors[name] = codes.float() * scale
    save_file(tensors, str(rounded / "model.safetensors"))
    prompts = _prompts(384, seed=5)
    assert _ours(source, prompts, quantization="fp8") == _transformers(rounded, prompts)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without CUDA (tests/gpu covers the kernels there)")
@pytest.mark.slow
def test_triton_kernels_equal_the_reference_path_in_the_interpreter(quantized_checkpoints) -> None:
    """attention_backend="triton" turns on the quantized GEMM kernel (run by Triton's interpreter here); the
    kernel itself is checked for every code type in tests/kernels/test_quant_matmul.py. Four tokens each of
    prompts of 6 and 19 over a 24-token budget are five steps that take every path: a prompt step (the GEMM
    at 24 rows), a decode beside a prompt's last token, decodes of both, and the longer one's last decode
    alone (one row: the GEMV); more tokens would repeat them in the interpreter."""
    path, _, _ = quantized_checkpoints["awq-g32"]
    prompts = _prompts(384)[1:3]
    triton, torch_ref = (_ours(path, prompts, 4, attention_backend=backend) for backend in ("triton", "torch"))
    assert triton == torch_ref


@pytest.mark.slow
def test_tensor_parallel_equals_one_rank(quantized_checkpoints) -> None:
    """Two CPU ranks: column-parallel rows and row-parallel input groups of the quantized tensors."""
    path, _, _ = quantized_checkpoints["awq-g32"]
    prompts = _prompts(384)
    assert _ours(path, prompts, tensor_parallel_size=2) == _ours(path, prompts)


@pytest.mark.slow
def test_tensor_parallel_fp8_at_load_equals_one_rank(tiny_checkpoints) -> None:
    path = tiny_checkpoints["qwen3"]
    prompts = _prompts(384)
    assert _ours(path, prompts, tensor_parallel_size=2, quantization="fp8") == _ours(path, prompts, quantization="fp8")


@pytest.mark.slow
def test_tensor_parallel_cut_inside_a_group_is_refused(quantized_checkpoints) -> None:
    """o_proj's 128 inputs split over two ranks cut AWQ's 128-input group in half."""
    path, _, _ = quantized_checkpoints["awq"]
    with pytest.raises(InvalidConfigError, match=r"splits model.layers.0.self_attn.o_proj's inputs at 0..64"):
        _ours(path, [[5, 6]], tensor_parallel_size=2)


@pytest.mark.parametrize(("variant", "quantization"), [("awq", None), ("gptq-int8", None), (None, "fp8")])
def test_dummy_weights_fill_quantized_layers(variant, quantization, quantized_checkpoints, tiny_checkpoints) -> None:
    """load_format="dummy" (benchmarks of real shapes) draws codes and scales too: finite log-probabilities."""
    path = tiny_checkpoints["qwen3"] if variant is None else quantized_checkpoints[variant][0]
    llm = LLM(str(path), load_format="dummy", quantization=quantization, **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    values = [lp for step in out.logprobs for lp in step.values()]
    assert len(out.token_ids) == 4 and all(v > -1e4 for v in values), values


def test_lora_on_a_quantized_model_is_refused_naming_why(quantized_checkpoints) -> None:
    """LoRA wraps unquantized linear layers only: an engine asked for both fails at build, saying so, instead
    of refusing every adapter later with an empty list of supported modules."""
    path, _, _ = quantized_checkpoints["awq"]
    with pytest.raises(InvalidConfigError, match=r"enable_lora=True.*quantized"):
        LLM(str(path), **ENGINE, enable_lora=True)
