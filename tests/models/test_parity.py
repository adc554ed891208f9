"""Our paged models against transformers (fp32, eager) on every tiny family: prefill, decode, chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.models.helpers import (
    Schedule,
    assert_logits_close,
    load_ours,
    load_reference,
    reference_logits,
    run_schedule,
)


@pytest.fixture(scope="module")
def models(family: str, tiny_checkpoints: dict[str, Path]) -> tuple[nn.Module, nn.Module]:
    path = tiny_checkpoints[family]
    return load_ours(path), load_reference(path)


def _random_seqs(vocab: int, lengths: list[int], seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {i: torch.randint(0, vocab, (n,), generator=gen) for i, n in enumerate(lengths)}


def _check(models: tuple[nn.Module, nn.Module], lengths: list[int], schedule: Schedule, seed: int) -> None:
    ours, ref = models
    seqs = _random_seqs(ours.arch.vocab_size, lengths, seed)
    got = run_schedule(ours, seqs, schedule, seed=seed)
    for seq_id, tokens in seqs.items():
        assert_logits_close(got[seq_id], reference_logits(ref, tokens))


def test_packed_prefill_then_batched_decode(models: tuple[nn.Module, nn.Module]) -> None:
    """Three prompts (7, 13, 5 tokens) prefilled in one packed step, then three decode steps together."""
    prefill = [(0, 7), (1, 13), (2, 5)]
    decode = [(0, 1), (1, 1), (2, 1)]
    _check(models, [10, 16, 8], [prefill, decode, decode, decode], seed=1)


def test_chunked_prefill_mixed_with_decode(models: tuple[nn.Module, nn.Module]) -> None:
    """Prompts split into 2-3 chunks across steps, sharing steps with other sequences' decodes."""
    schedule = [
        [(0, 4), (1, 9)],
        [(0, 5), (1, 1), (2, 3)],
        [(0, 2), (1, 1), (2, 3)],
        [(0, 1), (2, 1)],
    ]
    _check(models, [12, 11, 7], schedule, seed=2)


def test_block_size_one_and_long_prompt(models: tuple[nn.Module, nn.Module]) -> None:
    """Every token in its own shuffled block; one prompt spans many blocks."""
    ours, ref = models
    seqs = _random_seqs(ours.arch.vocab_size, [21, 3], seed=3)
    got = run_schedule(ours, seqs, [[(0, 20), (1, 3)], [(0, 1)]], block_size=1, seed=3)
    for seq_id, tokens in seqs.items():
        assert_logits_close(got[seq_id], reference_logits(ref, tokens))
