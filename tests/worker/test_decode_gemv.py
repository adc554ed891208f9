"""ASYNCLLM_DECODE_GEMV: dense linear layers taking the one-launch GEMV at one token row give the plain path's
tokens.

CPU (Triton's interpreter, float32, the Triton backend): greedy tokens with the GEMV forced on ("on") equal
those with it off, for one request decoding alone (every step one row: the GEMV); `runtime.gemv_layers` shows
which layers took it. The torch backend never takes it. On the GPU: tests/gpu/test_decode_gemv.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.errors import InvalidConfigError
from tests.fixtures.triton_kernels import HAS_CUDA

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
LINEARS_PER_LAYER = 4  # qkv, o, gate_up, down (the tiny models have 2 layers)
PROLOGUES_PER_LAYER = 3  # input norm -> qkv, post-attention add + norm -> gate_up, SiLU-and-mul -> down


def _run(path: Path, batches: list[list[list[int]]], **engine_args) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of each batch of prompts, one batch after the other; `runtime.gemv_layers` and
    `runtime.prologue_layers`."""
    llm = LLM(str(path), **engine_args)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = [o for prompts in batches for o in llm.generate(prompts, params, use_tqdm=False)]
        return [o.token_ids for o in outs], llm.runtime.gemv_layers, llm.runtime.prologue_layers
    finally:
        llm.shutdown()


def _tokens(path: Path, batches: list[list[list[int]]], **engine_args) -> tuple[list[list[int]], int]:
    """Greedy tokens of each batch of prompts, one batch after the other; and `runtime.gemv_layers`."""
    tokens, layers, _ = _run(path, batches, **engine_args)
    return tokens, layers


def _prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without CUDA (the GPU tests below run there)")
@pytest.mark.slow
def test_gemv_on_gives_the_tokens_of_gemv_off(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One request alone: every decode step one row, through the GEMV (more rows take F.linear: the layer's
    tests, tests/layers/test_linear_gemv.py); with "on", qkv, gate_up and down fold the norm (the residual add
    too) and SiLU-and-mul before them into their GEMV (layers/prologue.py)."""
    batches = [_prompts(300, (7,))]
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "on")
    on = _run(tiny_model, batches, attention_backend="triton", **ENGINE)
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "off")
    off = _run(tiny_model, batches, attention_backend="triton", **ENGINE)
    assert on[0] == off[0]
    assert on[1:] == (2 * LINEARS_PER_LAYER, 2 * PROLOGUES_PER_LAYER) and off[1:] == (0, 0)


def test_torch_backend_never_takes_the_gemv(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "on")
    _, layers = _tokens(tiny_model, [[[5, 6, 7]]], attention_backend="torch", **ENGINE)
    assert layers == 0


def test_bad_value_is_refused_naming_the_variable(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read when the engine is built: a bad value fails the build, naming the variable and its values."""
    monkeypatch.setenv("ASYNCLLM_DECODE_GEMV", "always")
    with pytest.raises(
        InvalidConfigError, match=r"ASYNCLLM_DECODE_GEMV='always' is invalid \(use one of auto, on, off\)"
    ):
        LLM(str(tiny_model), **ENGINE)


def test_decode_pdl_refused_without_cuda_naming_the_variable(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch is CUDA's (Hopper or newer) and the Triton backend's: asked for on the CPU
    or with the torch backend, the engine says so instead of ignoring it."""
    monkeypatch.setenv("ASYNCLLM_DECODE_PDL", "1")
    for backend in ("torch", "triton"):
        with pytest.raises(InvalidConfigError, match="ASYNCLLM_DECODE_PDL=1 launches the Triton backend's kernels"):
            LLM(str(tiny_model), attention_backend=backend, **ENGINE)
    monkeypatch.setenv("ASYNCLLM_DECODE_PDL", "yes")
    with pytest.raises(InvalidConfigError, match=r"ASYNCLLM_DECODE_PDL='yes' is invalid \(use 1, 0, true or false\)"):
        LLM(str(tiny_model), **ENGINE)
