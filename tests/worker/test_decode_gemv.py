"""`decode_gemv`: dense linear layers taking the one-launch GEMV at one token row give the plain path's tokens.

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
