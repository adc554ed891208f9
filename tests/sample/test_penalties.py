"""Repetition, presence and frequency penalties (counts kept on the device in a PenaltyTable) against a
plain-Python reference."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from asyncllm.sample.penalties import PenaltyTable
from asyncllm.sample.sampler import Sampler
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

VOCAB = 64


def _state(params: SamplingParams, prompt: list[int], output: list[int], table: PenaltyTable) -> SamplingState:
    """A state registered in `table` whose output so far is `output` (recorded one step at a time)."""
    state = SamplingState.create(params, seed=0, prompt_token_ids=prompt)
    table.add(state)
    for token in output:
        table.record([state], torch.tensor([token]))
    return state


def apply_penalties(logits: torch.Tensor, states: list[SamplingState], table: PenaltyTable) -> torch.Tensor:
    return table.apply(logits.clone(), states)


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
    table = PenaltyTable(VOCAB, torch.device("cpu"), initial_rows=2)  # grows as rows are taken
    states = [_state(params, prompt, output, table) for prompt, output in histories]
    got = apply_penalties(logits, states, table)
    for row, (prompt, output) in enumerate(histories):
        want = _reference(logits[row].tolist(), params, prompt, output)
        torch.testing.assert_close(got[row], torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_rows_without_penalties_are_untouched_and_input_is_not_modified() -> None:
    rng = random.Random(3)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    histories = [(_random_history(rng, 6), _random_history(rng, 10)) for _ in range(4)]
    params = [SamplingParams(), PENALTIES[4], SamplingParams(temperature=0.0), PENALTIES[0]]
    table = PenaltyTable(VOCAB, torch.device("cpu"))
    states = [_state(p, prompt, out, table) for p, (prompt, out) in zip(params, histories)]
    assert states[0].penalty_row is None and states[2].penalty_row is None  # only rows that ask get one
    got = table.apply(logits.clone(), states)
    assert torch.equal(logits, before)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    for row in (1, 3):
        want = _reference(logits[row].tolist(), params[row], *histories[row])
        torch.testing.assert_close(got[row], torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_no_penalties_returns_the_same_tensor() -> None:
    logits = torch.randn(3, VOCAB)
    table = PenaltyTable(VOCAB, torch.device("cpu"))
    states = [_state(SamplingParams(temperature=t), [1, 2], [3], table) for t in (0.0, 0.5, 1.0)]
    assert table.apply(logits, states) is logits


def test_presence_and_frequency_ignore_the_prompt() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    table = PenaltyTable(VOCAB, torch.device("cpu"))
    state = _state(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), [5, 5, 6], [], table)
    assert torch.equal(apply_penalties(logits, [state], table), logits)


def test_counts_count_duplicates_and_freed_rows_start_clean() -> None:
    table = PenaltyTable(10, torch.device("cpu"), initial_rows=1)
    a = _state(SamplingParams(frequency_penalty=1.0), [], [3, 3, 9], table)
    b = _state(SamplingParams(frequency_penalty=1.0), [], [0, 3], table)
    assert a.penalty_row is not None and b.penalty_row is not None
    assert table.counts[a.penalty_row].tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 1]
    assert table.counts[b.penalty_row].tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    table.remove(a)
    c = _state(SamplingParams(frequency_penalty=1.0), [], [], table)
    assert c.penalty_row == 0 and table.counts[c.penalty_row].sum() == 0


def test_greedy_picks_argmax_of_penalised_logits() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    top = int(logits.argmax())
    logits[0, top] = logits.max() + 0.5  # clear winner, so a strong penalty must move the choice
    greedy = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler = Sampler(VOCAB, "cpu")
    plain = sampler(logits, [_state(SamplingParams(temperature=0.0), [], [top], sampler.penalties)])
    penalised = sampler(logits, [_state(greedy, [], [top, top], sampler.penalties)])
    assert plain.token_ids.tolist() == [top]
    table = PenaltyTable(VOCAB, torch.device("cpu"))
    want = int(apply_penalties(logits, [_state(greedy, [], [top, top], table)], table).argmax())
    assert penalised.token_ids.tolist() == [want] and want != top
