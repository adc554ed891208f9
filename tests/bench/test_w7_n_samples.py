"""bench/w7_n_samples.py on CPU (toy `qwen3-tiny` shape, a few requests), so the device run does not find its
bugs first: both kinds of run make the same tokens, and `n` computes each prompt once where separate
requests without the prefix cache compute it n times."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.scripts import bench_script


@pytest.fixture(scope="module")
def w7() -> Iterator[ModuleType]:
    with bench_script("w7_n_samples", needs_tokenizer=True) as module:
        yield module


def test_separate_requests_are_the_samples_seeded_s_plus_i(w7: ModuleType) -> None:
    prompts, params = w7.w7_requests(3, 4, None)
    alone_prompts, alone_params = w7.separate(prompts, params)
    assert len(alone_prompts) == 12 and alone_prompts[5] == prompts[1]
    assert [p.seed for p in alone_params[4:8]] == [1000, 1001, 1002, 1003]
    assert {p.n for p in alone_params} == {1} and alone_params[4].max_tokens == params[1].max_tokens
    assert all(100 <= len(p) <= 1024 for p in prompts)


@pytest.mark.slow
def test_measure_runs_on_cpu(w7: ModuleType) -> None:
    argv = ["--shape", "qwen3-tiny", "--device", "cpu", "--num-seqs", "2", "--n", "3", "--max-tokens", "2"]
    args = w7.parser().parse_args([*argv, "--rounds", "1"])
    result = w7.measure(args, caching=False)
    assert result["output_tokens"] == 2 * 3 * 2
    n_prefill, separate_prefill = result["prefill_tokens_n_separate_no_prefix_cache"]
    prompt_tokens = result["prompt_tokens"]
    assert prompt_tokens <= n_prefill < prompt_tokens + 2 * 2 * 16  # each prompt once, plus 2 tails of a block
    assert separate_prefill == 3 * prompt_tokens
