"""The sampler end to end: greedy, temperature, seeded reproducibility in any batch, dtypes, logprobs.
On CPU the draw is the kernel's torch twin (tests/kernels/test_sampling.py compares the two)."""

from __future__ import annotations

import random

import pytest
import torch

from asyncllm.sample.sampler import Sampler
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

VOCAB = 300


def _logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _sampler(vocab: int = VOCAB) -> Sampler:
    return Sampler(vocab, "cpu")


def _states(params: list[SamplingParams], seeds: list[int], sampler: Sampler | None = None) -> list[SamplingState]:
    """One state per (params, seed), registered with `sampler` (penalty rows) when given."""
    rng = random.Random(sum(seeds))
    states = [SamplingState.create(p, seed, [rng.randrange(VOCAB) for _ in range(8)]) for p, seed in zip(params, seeds)]
    for state in states:
        if sampler is not None:
            sampler.add(state)
    return states


def test_greedy_is_argmax_whatever_the_seed() -> None:
    logits = _logits(6, seed=1)
    for seeds in (list(range(6)), [99] * 6):
        out = _sampler()(logits, _states([SamplingParams(temperature=0.0)] * 6, seeds))
        assert out.token_ids.dtype == torch.int64
        assert torch.equal(out.token_ids, logits.argmax(dim=-1))
        assert out.logprobs is None


def test_tiny_temperature_samples_greedily() -> None:
    logits = _logits(3, seed=2)
    states = _states([SamplingParams(temperature=1e-7)] * 3, [5, 6, 7])
    assert torch.equal(_sampler()(logits, states).token_ids, logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_are_argmax_and_random_rows_match_solo_runs() -> None:
    logits = _logits(4, seed=3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=20),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_p=0.8),
    ]
    tokens = _sampler()(logits, _states(params, [10, 11, 12, 13])).token_ids.tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    for row in (1, 3):
        solo = _sampler()(logits[row : row + 1], _states([params[row]], [10 + row])).token_ids.tolist()
        assert solo == [tokens[row]]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_frequencies_match_softmax(temperature: float) -> None:
    vocab, draws = 12, 4000
    row = _logits(1, seed=4, vocab=vocab)[0]
    states = [SamplingState.create(SamplingParams(temperature=temperature), s, [0]) for s in range(draws)]
    tokens = _sampler(vocab)(row.expand(draws, -1), states).token_ids
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = (row.double() / temperature).softmax(dim=0) * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 3 * (vocab - 1) + 25  # loose: mean 11, sd ~4.7 for the right distribution


PARAMS_UNDER_TEST = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.1, top_k=40, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
]


@pytest.mark.parametrize("params", PARAMS_UNDER_TEST, ids=["plain", "filters", "penalties"])
def test_seeded_output_is_independent_of_batch_composition_and_order(params: SamplingParams) -> None:
    """Request A (seed 1234) must produce the same tokens alone, first, last or in the middle of a batch."""
    steps = 6
    others = {
        "B": SamplingParams(temperature=0.0),
        "C": SamplingParams(top_k=5, repetition_penalty=1.5),
        "D": SamplingParams(temperature=1.4, min_p=0.1),
        "E": SamplingParams(top_p=0.5, frequency_penalty=1.0),
    }
    all_params = {"A": params, **others}
    seeds = {name: 1234 if name == "A" else 77 + i for i, name in enumerate(all_params)}
    # Each request's logits at each step are fixed, wherever its row lands in the batch.
    step_logits = [
        {name: _logits(1, seed=100 * step + i)[0] for i, name in enumerate(all_params)} for step in range(steps)
    ]
    compositions = [["A"], ["B", "A"], ["C", "D", "A", "B", "E"], ["A", "E", "C"], ["E", "A", "D"]]
    runs = []
    for names in compositions:
        sampler = _sampler()
        states = {}
        for name in names:
            prompt = list(range(0, 40, 3)) if name == "A" else [1, 2, 3]  # A's prompt is the same in every run
            states[name] = SamplingState.create(all_params[name], seeds[name], prompt)
            sampler.add(states[name])
        sampled = []
        for step in range(steps):
            logits = torch.stack([step_logits[step][n] for n in names])
            tokens = sampler(logits, [states[n] for n in names]).token_ids.tolist()
            sampled.append(tokens[names.index("A")])
        runs.append(sampled)
    assert all(run == runs[0] for run in runs), runs


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    vocab = 1000
    logits = _logits(1, seed=5, vocab=vocab).expand(3, -1) * 0.1  # flat: many likely tokens
    states = _states([SamplingParams()] * 3, [42, 42, 43])
    sequences: list[list[int]] = [[], [], []]
    sampler = _sampler(vocab)
    for _ in range(8):
        for seq, token in zip(sequences, sampler(logits, states).token_ids.tolist()):
            seq.append(token)
    assert sequences[0] == sequences[1]
    assert sequences[0] != sequences[2]


def test_huge_and_negative_seeds_are_accepted_and_deterministic() -> None:
    logits = _logits(2, seed=6)
    seeds = [2**80 + 3, -17]
    first = _sampler()(logits, _states([SamplingParams()] * 2, seeds)).token_ids
    again = _sampler()(logits, _states([SamplingParams()] * 2, seeds)).token_ids
    assert torch.equal(first, again)


def test_bf16_logits_sample_like_their_float32_values() -> None:
    logits = _logits(5, seed=7).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(top_k=10, top_p=0.9),
        SamplingParams(min_p=0.1, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    seeds = [1, 2, 3, 4, 5]
    bf16_sampler, f32_sampler = _sampler(), _sampler()
    from_bf16 = bf16_sampler(logits, _states(params, seeds, bf16_sampler))
    from_f32 = f32_sampler(logits.float(), _states(params, seeds, f32_sampler))
    assert torch.equal(from_bf16.token_ids, from_f32.token_ids)
    assert from_bf16.token_ids[0] == logits[0].float().argmax()
    assert from_bf16.logprobs == from_f32.logprobs


def test_sampler_does_not_modify_logits() -> None:
    logits = _logits(3, seed=8)
    before = logits.clone()
    params = [
        SamplingParams(top_k=3, top_p=0.5, min_p=0.2, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.3),
    ]
    sampler = _sampler()
    states = _states(params, [1, 2, 3], sampler)
    sampler(logits, states)  # a history for the penalties
    sampler(logits, states)
    assert torch.equal(logits, before)


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    logits = _logits(4, seed=9)
    params = [
        SamplingParams(logprobs=3, temperature=0.7, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(logprobs=5, top_k=2),
    ]
    sampler = _sampler()
    out = sampler(logits, _states(params, [1, 2, 3, 4], sampler))
    assert out.logprobs is not None and out.logprobs[1] is None
    want = logits.log_softmax(dim=-1)
    tokens = out.token_ids.tolist()
    for row, n in ((0, 3), (2, 0), (3, 5)):
        entry = out.logprobs[row]
        assert entry is not None
        top = want[row].topk(n).indices.tolist()
        assert set(entry) == {tokens[row], *top}
        assert next(iter(entry)) == tokens[row]  # the sampled token comes first
        for token, value in entry.items():
            assert value == pytest.approx(float(want[row, token]), abs=1e-5)
    assert out.logprobs[2] == {tokens[2]: pytest.approx(float(want[2, tokens[2]]), abs=1e-5)}


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_states=2"):
        _sampler()(_logits(3, seed=10), _states([SamplingParams()] * 2, [1, 2]))


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    """Regression: EOS sampled before min_tokens used to land in the output mid-answer."""
    vocab = 16
    logits = torch.full((1, vocab), -5.0)
    logits[0, 3] = 10.0  # EOS would win
    logits[0, 7] = 9.0  # a stop id is next best
    logits[0, 11] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    state = SamplingState.create(params, 0, [1, 2], eos_token_ids=frozenset({3}))
    sampler = _sampler(vocab)
    assert sampler(logits, [state]).token_ids.tolist() == [11]
    assert sampler(logits, [state]).token_ids.tolist() == [11]
    assert sampler(logits, [state]).token_ids.tolist() == [3]  # min_tokens reached: EOS allowed again
    ignoring = SamplingState.create(
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), 0, [1], eos_token_ids=frozenset({3})
    )
    assert sampler(logits, [ignoring]).token_ids.tolist() == [3]  # ignore_eos: EOS is just a token
