"""ASYNCLLM_DECODE_LAYER: one-row decode steps running each decoder layer as one persistent launch give the
chain's tokens.

CPU (Triton's interpreter, float32, the Triton backend): greedy tokens with the switch on equal those with it
off, for one request alone (every decode step through the kernel) and for three decoding together, ending at
different steps (steps of several rows through the chain, the last request's alone through the kernel);
`runtime.decode_layers` counts the layers switched. The torch backend never takes it. On the GPU:
tests/gpu/test_decode_layer.py (the kernel, and the engine with CUDA graphs) and the bench.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from tests.fixtures.triton_kernels import HAS_CUDA

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
LAYERS = 2  # the tiny models'

pytestmark = [
    pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without CUDA (tests/gpu covers the GPU)"),
    pytest.mark.slow,
]


def _run(path: Path, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], int]:
    llm = LLM(str(path), **engine_args)
    try:
        params = [SamplingParams(temperature=0, max_tokens=3 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.token_ids for o in outs], llm.runtime.decode_layers
    finally:
        llm.shutdown()


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("lengths", [(7,), (5, 13, 2)])
def test_one_launch_gives_the_chain_tokens(tiny_model: Path, monkeypatch: pytest.MonkeyPatch, lengths) -> None:
    prompts = _prompts(lengths)
    monkeypatch.setenv("ASYNCLLM_DECODE_LAYER", "1")
    on, switched = _run(tiny_model, prompts, attention_backend="triton", **ENGINE)
    monkeypatch.setenv("ASYNCLLM_DECODE_LAYER", "0")
    off, none = _run(tiny_model, prompts, attention_backend="triton", **ENGINE)
    assert on == off
    assert (switched, none) == (LAYERS, 0)


def test_the_torch_backend_never_takes_it(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_DECODE_LAYER", "1")
    _, switched = _run(tiny_model, _prompts((4,)), attention_backend="torch", **ENGINE)
    assert switched == 0


@pytest.mark.parametrize("mode", ["lines", "ahead"])
def test_an_explicit_prefetch_is_refused_off_cuda(tiny_model: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """ASYNCLLM_DECODE_LAYER_PREFETCH's modes ask a CUDA device's L2: refused before the weights load, naming it."""
    from asyncllm.errors import InvalidConfigError

    monkeypatch.setenv("ASYNCLLM_DECODE_LAYER", "1")
    monkeypatch.setenv("ASYNCLLM_DECODE_LAYER_PREFETCH", mode)
    with pytest.raises(InvalidConfigError, match=f"ASYNCLLM_DECODE_LAYER_PREFETCH={mode} asks a CUDA device's L2"):
        LLM(str(tiny_model), attention_backend="triton", **ENGINE)
