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


def _states(params: list[SamplingParams], seeds: list[int], sampler: Sampler) -> list[SamplingState]:
    """States with a prompt and an output history (recorded in the sampler's penalty table)."""
    states = [SamplingState.create(p, s, list(range(s % 7, 200, 3))) for p, s in zip(params, seeds)]
    history = torch.arange(5, 60, 4, device=sampler.device)
    for state in states:
        sampler.add(state)
        for token in history:
            sampler.penalties.record([state], token.view(1))
    return states


def test_sampling_without_logprobs_never_syncs_with_the_host() -> None:
    logits = torch.randn(len(MIXED), VOCAB, device="cuda", dtype=torch.bfloat16)
    sampler = Sampler(VOCAB, "cuda")
    states = _states(MIXED, list(range(len(MIXED))), sampler)
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
        sampler = Sampler(VOCAB, "cuda")
        states = dict(zip(names, _states([MIXED[n] for n in names], [1000 + n for n in names], sampler)))
        tokens = []
        for _ in range(4):
            out = sampler(torch.stack([rows[n] for n in names]), [states[n] for n in names])
            tokens.append(out.token_ids.tolist()[names.index(1)])
        seen.append(tokens)
    assert all(run == seen[0] for run in seen), seen


def test_cuda_sampling_matches_the_cpu_twin() -> None:
    """The Triton draw on the GPU and its torch twin on the CPU choose the same tokens (same noise bits;
    only an ulp of log could move a near-tie), greedy, random, filtered and penalised alike; logprobs agree."""
    logits = torch.randn(len(MIXED) * 4, VOCAB, device="cuda") * 3
    params = [p for p in MIXED for _ in range(4)]
    params[1] = SamplingParams(temperature=0.0, logprobs=4, repetition_penalty=1.3)
    seeds = list(range(len(params)))
    gpu_sampler, cpu_sampler = Sampler(VOCAB, "cuda"), Sampler(VOCAB, "cpu")
    gpu = gpu_sampler(logits, _states(params, seeds, gpu_sampler))
    cpu = cpu_sampler(logits.cpu(), _states(params, seeds, cpu_sampler))
    assert gpu.token_ids.tolist() == cpu.token_ids.tolist()
    assert gpu.logprobs is not None and cpu.logprobs is not None
    for g, c in zip(gpu.logprobs, cpu.logprobs):
        assert (g is None) == (c is None)
        if g is not None and c is not None:
            assert g.keys() == c.keys() and all(abs(g[t] - c[t]) < 1e-4 for t in g)
