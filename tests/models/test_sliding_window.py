"""Sliding-window models against transformers past the window: Mistral (every layer slides over 8 keys) and
Gemma 3 (8-key windows interleaved with a global layer), fp32, eager. Sequences run to 5x the window, in
chunks that start before, inside and after it and in single-token decodes; the window is shown to matter
(the same weights attending globally give other logits), so agreement is not an accident of short inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.model_loader.checkpoint import open_checkpoint
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class
from tests.models.helpers import assert_logits_close, load_reference, reference_logits, run_schedule

# A 40-token sequence in chunks of 5, 7 and 13 (crossing the 8-key window at different offsets), then 15
# decodes; a second one prefilled whole, decoding alongside.
SCHEDULE = [[(0, 5), (1, 22)], [(0, 7), (1, 1)], [(0, 13), (1, 1)]] + [[(0, 1), (1, 1)]] * 15


def _ours(path: Path, **arch_changes: object) -> torch.nn.Module:
    ckpt = open_checkpoint(str(path), torch.float32)
    arch = dataclasses.replace(ModelArchConfig.from_hf(ckpt.hf_config, None), **arch_changes)
    model = resolve_model_class(ckpt.hf_config)(arch, TorchAttentionBackend())
    model.load_weights(ckpt.iter_weights())
    return model.eval()


@pytest.mark.parametrize("family", ["gemma3", "mistral_swa"])
@pytest.mark.parametrize("block_size", [2, 4])
def test_logits_equal_transformers_past_the_window(family: str, block_size: int, tiny_checkpoints) -> None:
    path = tiny_checkpoints[family]
    ours, ref = _ours(path), load_reference(path)
    assert ours.arch.layer_window(0) == 8
    gen = torch.Generator().manual_seed(block_size)
    seqs = {0: torch.randint(0, ours.arch.vocab_size, (40,), generator=gen)}
    seqs[1] = torch.randint(0, ours.arch.vocab_size, (39,), generator=gen)
    got = run_schedule(ours, seqs, SCHEDULE, block_size=block_size)
    for seq_id, tokens in seqs.items():
        assert_logits_close(got[seq_id], reference_logits(ref, tokens))


@pytest.mark.parametrize("family", ["gemma3", "mistral_swa"])
def test_the_window_changes_the_logits(family: str, tiny_checkpoints) -> None:
    """Within the window, global attention is the same maths; past it, it is not. (The layers stay sliding
    ones, with Gemma's local rope base, but their window spans every position.)"""
    path = tiny_checkpoints[family]
    windowed = _ours(path)
    wide = tuple(None if w is None else windowed.arch.max_model_len for w in windowed.arch.layer_windows)
    unwindowed = _ours(path, layer_windows=wide)
    assert unwindowed.arch.layer_window(0) is None and unwindowed.arch.is_sliding(0)
    tokens = torch.randint(0, windowed.arch.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    a = run_schedule(windowed, {0: tokens}, [[(0, 30)]])[0]
    b = run_schedule(unwindowed, {0: tokens}, [[(0, 30)]])[0]
    torch.testing.assert_close(a[:8], b[:8], atol=1e-5, rtol=1e-5)
    assert (a[8:] - b[8:]).abs().amax() > 0.1 * a.abs().amax()
