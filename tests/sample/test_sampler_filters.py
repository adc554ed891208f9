"""top-k, top-p and min-p masks against plain per-row references, and sampling from the filtered set."""

from __future__ import annotations

import math

import pytest
import torch

from asyncllm.sample.filters import apply_min_p, apply_top_k_top_p
from asyncllm.sample.sampler import Sampler
from asyncllm.sample.state import SamplingState
from asyncllm.sampling_params import SamplingParams

VOCAB = 200


def _distinct_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    for row in logits:  # the references below assume no ties
        assert row.unique().numel() == vocab
    return logits


def _ref_top_k(row: list[float], k: int) -> set[int]:
    if k <= 0 or k >= len(row):
        return set(range(len(row)))
    order = sorted(range(len(row)), key=lambda i: -row[i])
    return set(order[:k])


def _ref_top_p(row: list[float], keep: set[int], p: float) -> set[int]:
    """Smallest prefix (by descending probability over `keep`) whose mass reaches p."""
    if p >= 1.0:
        return keep
    top = max(row[i] for i in keep)
    weights = {i: math.exp(row[i] - top) for i in keep}
    total = sum(weights.values())
    kept, mass = set(), 0.0
    for i in sorted(keep, key=lambda i: -row[i]):
        if mass >= p:
            break
        kept.add(i)
        mass += weights[i] / total
    return kept


def _ref_min_p(row: list[float], keep: set[int], min_p: float) -> set[int]:
    top = max(row[i] for i in keep)
    return {i for i in keep if math.exp(row[i] - top) >= min_p}


def _kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row != float("-inf")).flatten().tolist()) for row in masked]


TOP_K = [1, 5, 37, VOCAB - 1, VOCAB, 2, 100]  # VOCAB: off
TOP_P = [0.05, 0.3, 0.5, 0.9, 1.0, 0.99, 0.7]  # 1.0: off


@pytest.mark.parametrize("partial", [True, False], ids=["topk-partial", "full-width"])
def test_top_k_matches_reference(partial: bool) -> None:
    logits = _distinct_logits(len(TOP_K), VOCAB, seed=10)
    max_k = max(k for k in TOP_K if k < VOCAB) if partial else None
    masked = apply_top_k_top_p(logits.clone(), torch.tensor(TOP_K), None, max_k=max_k)
    for row, kept in enumerate(_kept(masked)):
        assert kept == _ref_top_k(logits[row].tolist(), TOP_K[row])
        assert torch.equal(masked[row, list(kept)], logits[row, list(kept)])  # survivors unchanged


def test_top_p_matches_reference() -> None:
    logits = _distinct_logits(len(TOP_P), VOCAB, seed=11)
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor(TOP_P))
    for row, kept in enumerate(_kept(masked)):
        assert kept == _ref_top_p(logits[row].tolist(), set(range(VOCAB)), TOP_P[row])


def test_top_k_then_top_p_matches_reference() -> None:
    logits = _distinct_logits(len(TOP_K), VOCAB, seed=12)
    masked = apply_top_k_top_p(logits.clone(), torch.tensor(TOP_K), torch.tensor(TOP_P))
    for row, kept in enumerate(_kept(masked)):
        values = logits[row].tolist()
        assert kept == _ref_top_p(values, _ref_top_k(values, TOP_K[row]), TOP_P[row])


def test_min_p_matches_reference() -> None:
    min_p = [0.0, 0.001, 0.05, 0.2, 0.5, 0.9, 1.0]
    logits = _distinct_logits(len(min_p), VOCAB, seed=13)
    masked = apply_min_p(logits.clone(), torch.tensor(min_p))
    for row, kept in enumerate(_kept(masked)):
        assert kept == _ref_min_p(logits[row].tolist(), set(range(VOCAB)), min_p[row])


def test_top_p_one_keeps_tokens_whose_probability_underflows() -> None:
    logits = _distinct_logits(2, VOCAB, seed=14)
    logits[:, :10] -= 500.0  # softmax of these is exactly 0 in float32
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([1.0, 0.999999]))
    assert torch.equal(masked[0], logits[0])


def test_extreme_settings_keep_at_least_the_top_token() -> None:
    logits = _distinct_logits(3, VOCAB, seed=15)
    best = logits.argmax(dim=-1).tolist()
    for kept, top in zip(_kept(apply_top_k_top_p(logits.clone(), None, torch.full((3,), 1e-9))), best):
        assert kept == {top}
    for kept, top in zip(_kept(apply_min_p(logits.clone(), torch.ones(3))), best):
        assert kept == {top}


def _sample_counts(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Tokens sampled from one row repeated `draws` times, each copy with its own seed."""
    states = [SamplingState.create(params, seed, [1]) for seed in range(draws)]
    tokens = Sampler(logits_row.numel(), "cpu")(logits_row.expand(draws, -1), states).token_ids
    return torch.bincount(tokens, minlength=logits_row.numel()).double()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the filters removed"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


FILTERS = [
    SamplingParams(temperature=0.8, top_k=6),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=9, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", FILTERS, ids=["top_k", "top_p", "min_p", "all"])
def test_filtered_sampling_follows_the_renormalised_distribution(params: SamplingParams) -> None:
    vocab = 16
    row = _distinct_logits(1, vocab, seed=16)[0]
    scaled = (row / params.temperature).tolist()
    keep = _ref_top_k(scaled, params.top_k)
    keep = _ref_min_p(scaled, _ref_top_p(scaled, keep, params.top_p), params.min_p)
    probs = torch.zeros(vocab, dtype=torch.float64)
    idx = torch.tensor(sorted(keep))
    probs[idx] = torch.tensor(scaled, dtype=torch.float64)[idx].softmax(dim=0)
    counts = _sample_counts(row, params, draws=3000)
    # Loose: len(keep) - 1 degrees of freedom have mean len(keep) - 1 and sd sqrt(2 (len(keep) - 1)).
    assert _chi_square(counts, probs) < 3 * len(keep) + 25


@pytest.mark.parametrize("top_k", [0, -1, VOCAB, VOCAB + 7])
def test_disabled_filters_change_nothing(top_k: int) -> None:
    logits = _distinct_logits(4, VOCAB, seed=17)
    plain = [SamplingState.create(SamplingParams(), seed, [1]) for seed in range(4)]
    off = SamplingParams(top_k=top_k, top_p=1.0, min_p=0.0)
    filtered = [SamplingState.create(off, seed, [1]) for seed in range(4)]
    sampler = Sampler(logits.shape[1], "cpu")
    assert torch.equal(sampler(logits, plain).token_ids, sampler(logits, filtered).token_ids)
