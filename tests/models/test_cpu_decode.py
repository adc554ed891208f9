"""The CPU decode path (models/cpu_decode.py) against its twin, the modules' forward, on tiny float32 models:
the same logits to float32 rounding (only attention sums in another order) at batch-1 and batched decode;
steps it does not take (prompt rows, unequal lengths) and families it does not reproduce go to the modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncllm.models import cpu_decode
from tests.models.helpers import load_ours, run_schedule

TAKEN = ["llama", "llama3", "qwen2", "mistral"]
PASSED = ["qwen3", "gemma3", "mistral_swa", "qwen3_moe"]  # q/k norms, Gemma's norms, windows, experts


def _both(model: torch.nn.Module, lengths: list[int], decodes: int, seed: int) -> tuple[dict, dict, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.arch.vocab_size
    seqs = {i: torch.randint(0, vocab, (n + decodes,), generator=gen) for i, n in enumerate(lengths)}
    schedule = [[(i, n) for i, n in enumerate(lengths)]] + [[(i, 1) for i in seqs]] * decodes
    taken: list[int] = []
    fast = cpu_decode.build(model)
    assert fast is not None

    def counting(*args: object) -> torch.Tensor | None:
        out = fast(*args)  # type: ignore[arg-type]
        taken.append(out is not None)
        return out

    model.cpu_decode = counting
    got = run_schedule(model, seqs, schedule, block_size=4, seed=seed)
    model.cpu_decode = None
    want = run_schedule(model, seqs, schedule, block_size=4, seed=seed)
    return got, want, taken


@pytest.mark.parametrize("family", TAKEN)
@pytest.mark.parametrize("lengths", [[9], [6, 6, 6]])
def test_decode_steps_match_the_modules(family: str, lengths: list[int], tiny_checkpoints: dict[str, Path]) -> None:
    model = load_ours(tiny_checkpoints[family])
    got, want, taken = _both(model, lengths, decodes=5, seed=len(lengths))
    assert taken == [False] + [True] * 5  # the prompt step is the modules', every decode step the path's
    for seq_id, logits in want.items():
        torch.testing.assert_close(got[seq_id], logits, rtol=1e-5, atol=1e-5)


def test_unequal_lengths_take_the_modules(tiny_checkpoints: dict[str, Path]) -> None:
    model = load_ours(tiny_checkpoints["llama"])
    got, want, taken = _both(model, [5, 8], decodes=2, seed=3)
    assert not any(taken)
    for seq_id, logits in want.items():
        assert torch.equal(got[seq_id], logits)


@pytest.mark.parametrize("family", PASSED)
def test_families_it_does_not_reproduce_are_left_alone(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    assert cpu_decode.build(load_ours(tiny_checkpoints[family])) is None
