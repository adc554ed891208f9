"""The sampler on a CUDA device: no host sync, batch-independent seeded sampling at a real vocabulary size."""

from __future__ import annotations

import pytest
import torch

from asyncllm.sample.sampler import Sampler
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 151_936  # Qwen-sized, so the sort / top-k paths run at the width they meet in production
MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2),
    SamplingParams(temperature=0.7, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=1.0, top_k=20),
]


def _states(params: list[SamplingParams], seeds: list[int]) -> list[SamplingState]:
    states = [SamplingState.create(p, s, list(range(s % 7, 200, 3)), "cuda") for p, s in zip(params, seeds)]
    for state in states:
        for token in range(5, 60, 4):
            state.record(token)
    return states


def test_sampling_without_logprobs_never_syncs_with_the_host() -> None:
    logits = torch.randn(len(MIXED), VOCAB, device="cuda", dtype=torch.bfloat16)
    states = _states(MIXED, list(range(len(MIXED))))
    sampler = Sampler()
    sampler(logits, states)  # warm up allocators outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, states)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (len(MIXED),) and out.token_ids.is_cuda


def test_cuda_seeded_tokens_are_independent_of_the_batch() -> None:
    rows = {i: torch.randn(VOCAB, device="cuda") * 3 for i in range(len(MIXED))}
    compositions = [[1], [0, 1, 2], [4, 3, 2, 1, 0], [1, 4]]
    seen: list[list[int]] = []
    for names in compositions:
        states = dict(zip(names, _states([MIXED[n] for n in names], [1000 + n for n in names])))
        tokens = []
        for _ in range(4):
            out = Sampler()(torch.stack([rows[n] for n in names]), [states[n] for n in names])
            for name, token in zip(names, out.token_ids.tolist()):
                states[name].record(token)
            tokens.append(out.token_ids.tolist()[names.index(1)])
        seen.append(tokens)
    assert all(run == seen[0] for run in seen), seen


def test_cuda_greedy_and_logprobs_match_cpu() -> None:
    logits = torch.randn(3, VOCAB, device="cuda")
    params = [SamplingParams(temperature=0.0, logprobs=4, repetition_penalty=1.3)] * 3
    gpu = Sampler()(logits, _states(params, [1, 2, 3]))
    cpu_states = [
        SamplingState.create(p, s.generator.initial_seed(), s.prompt_token_ids, "cpu")
        for p, s in zip(params, _states(params, [1, 2, 3]))
    ]
    for state in cpu_states:
        state.output_token_ids = list(range(5, 60, 4))
    cpu = Sampler()(logits.cpu(), cpu_states)
    assert gpu.token_ids.tolist() == cpu.token_ids.tolist()
    assert gpu.logprobs is not None and cpu.logprobs is not None
    for g, c in zip(gpu.logprobs, cpu.logprobs):
        assert g is not None and c is not None and g.keys() == c.keys()
        assert all(abs(g[t] - c[t]) < 1e-4 for t in g)
