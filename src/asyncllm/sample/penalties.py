"""Repetition, presence and frequency penalties on a batch of logits (vLLM / OpenAI semantics).

Repetition divides positive logits and multiplies negative ones of every token seen in the prompt or the
output; presence and frequency subtract per output token (once, and once per occurrence). Only rows that
ask for a penalty are touched. Knows nothing of temperature, filtering or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncllm.layers.host_copy import to_device
from asyncllm.sample.state import SamplingState


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """[N, vocab] float32 -> penalised [N, vocab] float32. Never writes into `logits`.

    Returns `logits` itself when no row has a penalty, so the common case costs nothing.
    """
    assert logits.dtype == torch.float32 and logits.shape[0] == len(states)
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    subset = len(rows) < len(states)
    row_index = to_device(rows, torch.int64, device) if subset else None
    x = logits.index_select(0, row_index) if row_index is not None else logits.clone()  # [R, vocab]
    params = [states[i].params for i in rows]
    output_counts = token_counts([states[i].output_tensor() for i in rows], vocab, device)  # [R, vocab]

    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        prompt_seen = token_counts([states[i].prompt_tensor() for i in rows], vocab, device) > 0
        seen = prompt_seen | (output_counts > 0)
        penalty = to_device(repetition, torch.float32, device).unsqueeze(1)  # [R, 1]
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)

    frequency = [p.frequency_penalty for p in params]
    if any(f != 0.0 for f in frequency):
        x -= to_device(frequency, torch.float32, device).unsqueeze(1) * output_counts
    presence = [p.presence_penalty for p in params]
    if any(p != 0.0 for p in presence):
        x -= to_device(presence, torch.float32, device).unsqueeze(1) * (output_counts > 0)

    if row_index is None:
        return x
    return logits.index_copy(0, row_index, x)


def token_counts(token_lists: Sequence[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each host int64 tensor.

    Built from one flat (row, token) index list, so no row is padded to the longest history.
    """
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    lengths = torch.tensor([t.numel() for t in token_lists], dtype=torch.int64)
    if int(lengths.sum()) == 0:
        return counts
    row_ids = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)  # on the host: no sync
    pairs = to_device(torch.cat([row_ids, *token_lists]), torch.int64, device)  # one copy for both
    rows, tokens = pairs.view(2, -1)
    # Accumulating ones is exact in float32 whatever order the device adds them in.
    counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
    return counts
