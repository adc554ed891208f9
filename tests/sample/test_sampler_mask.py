"""The sampler with a token bitmask (structured output): constrained rows only ever draw allowed tokens, on
every path (greedy-only batches, plain draws, filters, penalties); the mask is applied before top-k/top-p so
the filters choose among allowed tokens; unconstrained rows draw exactly what they draw without a mask;
logprobs are those of the raw logits."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels.sampling_ref import token_bitmask_allowed
from asyncllm.sample.sampler import Sampler, TokenMask
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

VOCAB = 300
WORDS = -(-VOCAB // 32)


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _bitmask(rows: int, seed: int, density: float = 0.1) -> torch.Tensor:
    """[rows, WORDS] int32 with about `density` of the vocabulary allowed per row (at least one token)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, WORDS * 32, generator=g) < density
    allowed[:, VOCAB:] = False
    allowed[torch.arange(rows), torch.randint(0, VOCAB, (rows,), generator=g)] = True
    words = (allowed.view(rows, WORDS, 32).long() << torch.arange(32)).sum(-1)  # [rows, WORDS] int64
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _states(params: list[SamplingParams], constrained: list[bool], sampler: Sampler) -> list[SamplingState]:
    states = [SamplingState.create(p, seed=40 + i, prompt_token_ids=[1, 2, 3]) for i, p in enumerate(params)]
    for state, masked in zip(states, constrained):
        sampler.add(state)
        if masked:
            state.constrained = True  # the sampler reads only that (a runner's state: `params.structured` set)
    return states


def _mask(constrained: list[bool], seed: int) -> tuple[TokenMask, torch.Tensor]:
    rows, n = [], 0
    for masked in constrained:
        rows.append(n if masked else -1)
        n += masked
    bitmask = _bitmask(n, seed)
    mask_rows = torch.tensor(rows, dtype=torch.int64)
    return TokenMask(bitmask, mask_rows), token_bitmask_allowed(bitmask, mask_rows, VOCAB)


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.3, top_k=1),  # top-k of the unmasked row would keep a forbidden token
    SamplingParams(temperature=0.9, top_p=0.5, min_p=0.1),
    SamplingParams(temperature=0.8, repetition_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0.0, frequency_penalty=1.0),
]


def test_constrained_rows_draw_allowed_tokens_and_the_others_are_unaffected() -> None:
    for seed in range(5):
        constrained = [i % 2 == seed % 2 for i in range(len(PARAMS))] + [True, False]
        params = [*PARAMS, SamplingParams(top_k=3), SamplingParams(top_k=3)]
        logits = _logits(len(params), seed)
        mask, allowed = _mask(constrained, seed)
        masked_sampler, plain_sampler = Sampler(VOCAB, "cpu"), Sampler(VOCAB, "cpu")
        masked = masked_sampler(logits, _states(params, constrained, masked_sampler), mask=mask).token_ids
        plain = plain_sampler(logits, _states(params, [False] * len(params), plain_sampler)).token_ids
        for row, is_constrained in enumerate(constrained):
            if is_constrained:
                assert allowed[row, masked[row]], (seed, row)
            else:
                assert masked[row] == plain[row], (seed, row)


def test_greedy_only_batch_takes_the_best_allowed_token_and_top_k_one_too() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    constrained = [True, False, True]
    logits = _logits(3, seed=9)
    mask, allowed = _mask(constrained, seed=9)
    best = logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1)
    greedy = Sampler(VOCAB, "cpu")
    out = greedy(
        logits[:2], _states(params[:2], constrained[:2], greedy), mask=TokenMask(mask.bitmask, mask.mask_rows[:2])
    )
    assert out.token_ids.tolist() == [best[0], logits[1].argmax()]
    top1 = Sampler(VOCAB, "cpu")
    out = top1(
        logits[2:], _states(params[2:], constrained[2:], top1), mask=TokenMask(mask.bitmask[1:], torch.tensor([0]))
    )
    assert out.token_ids.tolist() == [best[2]]


def test_logprobs_are_the_raw_logits() -> None:
    params = [SamplingParams(temperature=1.0, logprobs=2)]
    logits = _logits(1, seed=4)
    mask, _ = _mask([True], seed=4)
    sampler = Sampler(VOCAB, "cpu")
    out = sampler(logits, _states(params, [True], sampler), mask=mask)
    entry = out.logprobs[0]
    raw = logits.log_softmax(dim=-1)[0]
    token = int(out.token_ids[0])
    assert entry[token] == pytest.approx(float(raw[token]), abs=1e-6)
    assert set(raw.topk(2).indices.tolist()) <= set(entry)
