"""Repetition, presence and frequency penalties against a plain-Python reference."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from asyncllm.sample.penalties import apply_penalties, token_counts
from asyncllm.sample.sampler import Sampler
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

VOCAB = 64


def _state(params: SamplingParams, prompt: list[int], output: list[int]) -> SamplingState:
    state = SamplingState.create(params, seed=0, prompt_token_ids=prompt, device="cpu")
    for token in output:
        state.record(token)
    return state


def _reference(row: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM semantics written out token by token."""
    out = list(row)
    rep = params.repetition_penalty
    for token in set(prompt) | set(output):
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token, count in Counter(output).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def _random_history(rng: random.Random, length: int) -> list[int]:
    # A small pool forces repeats, so counts above one are exercised.
    pool = rng.sample(range(VOCAB), 12)
    return [rng.choice(pool) for _ in range(length)]


PENALTIES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=0.9),
    SamplingParams(frequency_penalty=-0.4),
    SamplingParams(frequency_penalty=1.3, presence_penalty=-1.1, repetition_penalty=1.2),
]


@pytest.mark.parametrize("params", PENALTIES, ids=lambda p: f"rep{p.repetition_penalty}-pres{p.presence_penalty}")
def test_each_penalty_matches_reference(params: SamplingParams) -> None:
    rng = random.Random(7)
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    histories = [(_random_history(rng, 9), _random_history(rng, n)) for n in (0, 1, 7, 20, 33)]
    states = [_state(params, prompt, output) for prompt, output in histories]
    got = apply_penalties(logits, states)
    for row, (prompt, output) in enumerate(histories):
        want = _reference(logits[row].tolist(), params, prompt, output)
        torch.testing.assert_close(got[row], torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_rows_without_penalties_are_untouched_and_input_is_not_modified() -> None:
    rng = random.Random(3)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    histories = [(_random_history(rng, 6), _random_history(rng, 10)) for _ in range(4)]
    params = [SamplingParams(), PENALTIES[4], SamplingParams(temperature=0.0), PENALTIES[0]]
    states = [_state(p, prompt, out) for p, (prompt, out) in zip(params, histories)]
    got = apply_penalties(logits, states)
    assert torch.equal(logits, before)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    for row in (1, 3):
        want = _reference(logits[row].tolist(), params[row], *histories[row])
        torch.testing.assert_close(got[row], torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_no_penalties_returns_the_same_tensor() -> None:
    logits = torch.randn(3, VOCAB)
    states = [_state(SamplingParams(temperature=t), [1, 2], [3]) for t in (0.0, 0.5, 1.0)]
    assert apply_penalties(logits, states) is logits


def test_presence_and_frequency_ignore_the_prompt() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    state = _state(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), [5, 5, 6], [])
    assert torch.equal(apply_penalties(logits, [state]), logits)


def test_token_counts_counts_duplicates_per_row() -> None:
    lists = [torch.tensor(t, dtype=torch.int64) for t in ([3, 3, 9], [], [0, 3])]
    counts = token_counts(lists, vocab=10, device=torch.device("cpu"))
    want = torch.zeros(3, 10)
    want[0, 3], want[0, 9], want[2, 0], want[2, 3] = 2, 1, 1, 1
    assert torch.equal(counts, want)


def test_greedy_picks_argmax_of_penalised_logits() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    top = int(logits.argmax())
    logits[0, top] = logits.max() + 0.5  # clear winner, so a strong penalty must move the choice
    greedy = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    plain = Sampler()(logits, [_state(SamplingParams(temperature=0.0), [], [top])])
    penalised = Sampler()(logits, [_state(greedy, [], [top, top])])
    assert plain.token_ids.tolist() == [top]
    want = int(apply_penalties(logits, [_state(greedy, [], [top, top])]).argmax())
    assert penalised.token_ids.tolist() == [want] and want != top


def test_host_token_copy_follows_the_list_as_it_grows_and_when_replaced() -> None:
    state = SamplingState.create(SamplingParams(), seed=0, prompt_token_ids=[4, 5], device="cpu")
    rng = random.Random(8)
    for _ in range(40):  # crosses several buffer doublings
        state.record(rng.randrange(VOCAB))
        assert state.output_tensor().tolist() == state.output_token_ids
    state.output_token_ids = [9, 8, 7]
    assert state.output_tensor().tolist() == [9, 8, 7]
    assert state.prompt_tensor().tolist() == [4, 5]
