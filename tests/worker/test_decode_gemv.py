"""`decode_gemv`: dense linear layers taking the one-launch GEMV at one token row give the plain path's tokens.

CPU (Triton's interpreter, float32, the Triton backend): greedy tokens with the GEMV forced on ("on") equal
those with it off, for one request decoding alone (every step one row: the GEMV); `runtime.gemv_layers` shows
which layers took it. The torch backend never takes it. GPU: graphs
against eager with the GEMV on (float32 and bfloat16), and the start-up timing ("auto") on real decode shapes.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.errors import InvalidConfigError
from tests.fixtures.triton_kernels import HAS_CUDA

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
LINEARS_PER_LAYER = 4  # qkv, o, gate_up, down (the tiny models have 2 layers)


def _tokens(path: Path, batches: list[list[list[int]]], **engine_args) -> tuple[list[list[int]], int]:
    """Greedy tokens of each batch of prompts, one batch after the other; and `runtime.gemv_layers`."""
    llm = LLM(str(path), **engine_args)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = [o for prompts in batches for o in llm.generate(prompts, params, use_tqdm=False)]
        return [o.token_ids for o in outs], llm.runtime.gemv_layers
    finally:
        llm.shutdown()


def _prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without CUDA (the GPU tests below run there)")
def test_gemv_on_gives_the_tokens_of_gemv_off(tiny_model: Path) -> None:
    """One request alone: every decode step one row, through the GEMV (more rows take F.linear: the layer's
    tests, tests/layers/test_linear_gemv.py)."""
    batches = [_prompts(300, (7,))]
    on, on_layers = _tokens(tiny_model, batches, attention_backend="triton", decode_gemv="on", **ENGINE)
    off, off_layers = _tokens(tiny_model, batches, attention_backend="triton", decode_gemv="off", **ENGINE)
    assert on == off
    assert (on_layers, off_layers) == (2 * LINEARS_PER_LAYER, 0)


def test_torch_backend_never_takes_the_gemv(tiny_model: Path) -> None:
    _, layers = _tokens(tiny_model, [[[5, 6, 7]]], attention_backend="torch", decode_gemv="on", **ENGINE)
    assert layers == 0


def test_bad_value_is_refused_naming_the_field(tiny_model: Path) -> None:
    with pytest.raises(InvalidConfigError, match="decode_gemv='always' is invalid: use one of 'auto', 'on', 'off'"):
        LLM(str(tiny_model), decode_gemv="always", **ENGINE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.usefixtures("exact_fp32")
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_graphs_equal_eager_with_the_gemv_on(tiny_model: Path, dtype: str) -> None:
    """Batch-1 decode steps replay graphs that captured the GEMV; eager steps launch it: the same tokens."""
    common = dict(device="cuda", dtype=dtype, block_size=4, num_kv_blocks=256, decode_gemv="on")
    batches = [_prompts(300, (9,)), _prompts(300, (4, 13))]
    graphs, layers = _tokens(tiny_model, batches, **common)
    eager, _ = _tokens(tiny_model, batches, enforce_eager=True, **common)
    assert graphs == eager and layers == 2 * LINEARS_PER_LAYER
    off, _ = _tokens(tiny_model, batches, **{**common, "decode_gemv": "off"})
    if dtype == "float32":
        assert graphs == off


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_auto_times_real_decode_shapes(tiny_model: Path, tmp_path: Path) -> None:
    """Two layers of Qwen3-0.6B's shapes (random weights, the tiny tokenizer), bfloat16 with CUDA graphs:
    "auto" times each shape at start-up (within the tune_gemm phase) and decodes; a shape's choice covers
    all its layers."""
    path = tmp_path / "wide"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128)  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), device="cuda", dtype="bfloat16", load_format="dummy", num_kv_blocks=64)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 6
        assert llm.runtime.gemv_layers % 2 == 0  # both layers of a shape, or neither
        assert dict(llm.runtime.startup_seconds)["tune_gemm"] < 1.0
    finally:
        llm.shutdown()
