"""Prompt logprobs on the GPU: the fast paths (steps carrying prompt chunks replayed from CUDA graphs, step N+1
planned while N runs, the scored rows' logprobs read back a step later, the LM head at padded row counts) give
what their slow twins (eager, serial) give, under chunked prefill and preemption; and requests that do not ask
get the tokens they get when nobody asks."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.fixtures.envs import serial_llm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _workload(vocab: int, scored: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 60))] for _ in range(24)]
    params = [
        SamplingParams(temperature=0, max_tokens=3 + i % 5, ignore_eos=True, prompt_logprobs=i % 4 if scored else None)
        if i % 3
        else SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i in range(24)
    ]
    return prompts, params


def _close(a: Any, b: Any, tol: float) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        (x is None and y is None) or (x.keys() == y.keys() and all(abs(x[t] - y[t]) < tol for t in x))
        for x, y in zip(a, b)
    )


@pytest.mark.usefixtures("exact_fp32")
def test_graphs_and_overlap_equal_eager_and_serial(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["qwen3"])
    # No prefix cache: the last run repeats the prompts, and hits would change the chunking it is compared under
    common = dict(
        device="cuda", dtype="float32", block_size=4, max_num_seqs=16, num_kv_blocks=32, enable_prefix_caching=False
    )
    fast = LLM(path, max_num_batched_tokens=64, **common)
    slow = serial_llm(path, max_num_batched_tokens=64, enforce_eager=True, **common)
    assert fast.runtime.cuda_graph_token_sizes  # prompt chunks replay graphs
    prompts, params = _workload(fast.runtime.vocab_size, scored=True)
    ours = fast.generate(prompts, params, use_tqdm=False)
    ref = slow.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
    for prompt, p, o, r in zip(prompts, params, ours, ref):
        if p.prompt_logprobs is None:
            assert o.prompt_logprobs is None
        else:
            assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(prompt)
            assert _close(o.prompt_logprobs, r.prompt_logprobs, 1e-4)
    assert fast.stats()["num_preemptions"] > 0
    # Requests that do not ask: the tokens they get when no request asks
    _, plain = _workload(fast.runtime.vocab_size, scored=False)
    alone = fast.generate(prompts, plain, use_tqdm=False)
    assert [o.token_ids for o in alone] == [o.token_ids for o in ours]
    assert all(o.prompt_logprobs is None for o in alone)
    stats = fast.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
