"""Log-probabilities a request asked for: computed on the device with the step, read on the host later.

`gather_logprobs` launches the maths (log_softmax of the raw logits, the sampled token's value and the top
alternatives) without waiting; `LogprobsOutput.to_dicts` turns the one packed tensor into per-row dicts
once the caller has synchronised (with the step's sampled ids). The packing (`pack_logprobs`, `to_pinned`,
`unpack`) is shared with the prompt's logprobs (`prompt_logprobs.py`). Knows nothing of how tokens were chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncllm.layers.host_copy import to_device
from asyncllm.sample.state import SamplingState


@dataclass
class LogprobsOutput:
    rows: list[int]  # batch rows that asked
    counts: list[int]  # alternatives each of those rows asked for
    num_top: int
    packed: torch.Tensor  # [len(rows), 2 + 2 * num_top] float64: sampled id, its logprob, top ids, top logprobs
    num_rows: int  # rows in the batch

    def to_host(self) -> LogprobsOutput:
        """Start the device-to-host copy (pinned, non-blocking); read with `to_dicts` after a sync."""
        self.packed = to_pinned(self.packed)
        return self

    def to_dicts(self) -> list[dict[int, float] | None]:
        result: list[dict[int, float] | None] = [None] * self.num_rows
        for row, n, values in zip(self.rows, self.counts, self.packed.tolist()):
            result[row] = unpack(values, self.num_top, n)
        return result


def pack_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int) -> torch.Tensor:
    """[R, vocab] float32 log-probabilities and [R, 1] int64 chosen ids -> [R, 2 + 2 * num_top] float64: each
    row's chosen id, its logprob, the top ids, their logprobs. One tensor to copy back: ids ride along as
    float64, exact for any vocabulary size."""
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [R, num_top]
    parts = [chosen, logprobs.gather(1, chosen), top_ids, top_values]
    return torch.cat([part.to(torch.float64) for part in parts], dim=1)


def to_pinned(packed: torch.Tensor) -> torch.Tensor:
    """Start a CUDA tensor's copy to pinned host memory (non-blocking: read it after a sync); others as they are."""
    if packed.device.type != "cuda":
        return packed
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    return host


def unpack(values: list[float], num_top: int, n: int) -> dict[int, float]:
    """One packed row as {token id: logprob}: the chosen token, then its row's first `n` top alternatives."""
    entry = {int(values[0]): values[1]}
    ids, lps = values[2 : 2 + num_top], values[2 + num_top :]
    for token, lp in zip(ids[:n], lps[:n]):
        entry.setdefault(int(token), lp)
    return entry


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, states: Sequence[SamplingState]
) -> LogprobsOutput | None:
    """log_softmax of the raw logits for rows that asked: the sampled token and the top-n alternatives."""
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return None
    counts = [states[i].params.logprobs or 0 for i in rows]
    row_index = to_device(rows, torch.int64, logits.device)
    logprobs = logits.index_select(0, row_index).float().log_softmax(dim=-1)  # [R, vocab]
    sampled = token_ids.index_select(0, row_index).unsqueeze(1)  # [R, 1]
    num_top = min(max(counts), logprobs.shape[1])
    return LogprobsOutput(rows, counts, num_top, pack_logprobs(logprobs, sampled, num_top), len(states))
