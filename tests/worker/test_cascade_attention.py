"""ASYNCLLM_CASCADE_ATTENTION: decode steps reading a shared prompt prefix once per group give the plain path's
tokens.

CPU (Triton's interpreter, float32, the Triton backend): four requests whose prompts share a 132-token prefix
(33 blocks of 4, over the 128-token minimum), admitted after a first request cached it, so their block tables
share its physical blocks (`num_cached_tokens` shows it) and their decode steps take the cascade plan: greedy
tokens with cascade "on" equal those with it "off". The switch's checks: a bad value, and "on" with the torch
backend (the reference has no cascade). On the GPU: tests/gpu/test_cascade_attention.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.errors import InvalidConfigError
from tests.fixtures.triton_kernels import HAS_CUDA

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=512)
PREFIX = 132


@pytest.fixture(autouse=True)
def _no_mixed_step_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter would run a prompt step's padding rows too; decode steps keep their buckets, whose plans
    are the cascade's."""
    monkeypatch.setenv("ASYNCLLM_CUDA_GRAPH_MAX_TOKENS", "0")


def shared_prompts(vocab: int, num: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))] for _ in range(num)]


def tokens(path: Path, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of `prompts` after the first alone (it fills the prefix cache: one token), and how many
    prompt tokens each of the rest found cached. A one-token request runs before them and takes block 0,
    which the cascade never shares (a padding row's table is all 0s): a prefix cached from block 0 on would
    leave every decode step on the plain plan."""
    llm = LLM(str(path), **engine_args)
    try:
        llm.generate([[7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        first = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)  # decode steps of 4 sharing the prefix
        return [o.token_ids for o in first + rest], [o.metrics.num_cached_tokens for o in rest]
    finally:
        llm.shutdown()


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without CUDA (tests/gpu runs the GPU's)")
@pytest.mark.slow
def test_cascade_on_gives_the_tokens_of_the_reference(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels with cascade, in the interpreter, against the torch backend (the specification the
    plain Triton path is held to in tests/attention/test_triton_backend.py): the same greedy tokens."""
    prompts = shared_prompts(300, 5)
    monkeypatch.setenv("ASYNCLLM_CASCADE_ATTENTION", "on")
    on, cached = tokens(tiny_model, prompts, attention_backend="triton", **ENGINE)
    monkeypatch.setenv("ASYNCLLM_CASCADE_ATTENTION", "off")
    reference, _ = tokens(tiny_model, prompts, attention_backend="torch", **ENGINE)
    assert min(cached) >= PREFIX  # the prefix's blocks are shared: the cascade has groups to read
    assert on == reference


def test_bad_value_is_refused_naming_the_variable(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_CASCADE_ATTENTION", "yes")
    with pytest.raises(
        InvalidConfigError, match=r"ASYNCLLM_CASCADE_ATTENTION='yes' is invalid \(use one of auto, on, off\)"
    ):
        LLM(str(tiny_model), **ENGINE)


def test_on_with_the_torch_backend_is_refused(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLLM_CASCADE_ATTENTION", "on")
    with pytest.raises(InvalidConfigError, match="ASYNCLLM_CASCADE_ATTENTION=on needs attention_backend='triton'"):
        LLM(str(tiny_model), attention_backend="torch", **ENGINE)


def test_auto_on_cpu_runs_the_reference(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU default ("auto" resolves to the torch backend there): accepted, and no cascade to run."""
    monkeypatch.setenv("ASYNCLLM_CASCADE_ATTENTION", "auto")
    got, _ = tokens(tiny_model, shared_prompts(300, 2), **ENGINE)
    assert [len(t) for t in got] == [1, 4]
