"""Repetition, presence and frequency penalties (vLLM / OpenAI semantics) from counts kept on the device.

Repetition divides positive logits and multiplies negative ones of every token seen in the prompt or the
output; presence and frequency subtract per output token (once, and once per occurrence). A request that
asks for a penalty gets a row in `PenaltyTable`: its output-token counts and its prompt's token set live on
the device and grow by one scatter per step from the sampled ids, which never visit the host for this.
Only rows that ask are touched. Knows nothing of temperature, filtering or noise.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from asyncllm.layers.host_copy import to_device
from asyncllm.sample.state import SamplingState


class PenaltyTable:
    """Device rows of [vocab] output counts (float32, exact up to 2**24) and prompt-seen masks."""

    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(initial_rows, vocab_size, dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros(initial_rows, vocab_size, dtype=torch.bool, device=device)
        self._free = list(range(initial_rows - 1, -1, -1))

    def add(self, state: SamplingState) -> None:
        """Give a request with penalties its row (no-op for one without)."""
        if not state.params.has_penalties or state.penalty_row is not None:
            return
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.counts[row].zero_()
        self.prompt_seen[row].zero_()
        if state.params.repetition_penalty != 1.0 and state.prompt_token_ids:
            ids = to_device([t for t in state.prompt_token_ids if 0 <= t < self.vocab_size], torch.int64, self.device)
            self.prompt_seen[row, ids] = True
        state.penalty_row = row

    def remove(self, state: SamplingState) -> None:
        if state.penalty_row is not None:
            self._free.append(state.penalty_row)
            state.penalty_row = None

    def record(self, states: Sequence[SamplingState], token_ids: torch.Tensor, skip: Collection[int] = ()) -> None:
        """Count each state's sampled token ([len(states)] int64 on the device) for rows with penalties, but
        rows `skip` (a deferred draw's token is never output)."""
        picks = [(i, s.penalty_row) for i, s in enumerate(states) if s.penalty_row is not None and i not in skip]
        if not picks:
            return
        index = to_device([v for pair in picks for v in pair], torch.int64, self.device).view(-1, 2)
        tokens = token_ids.index_select(0, index[:, 0])
        ones = torch.ones(len(picks), dtype=torch.float32, device=self.device)
        self.counts.index_put_((index[:, 1], tokens), ones, accumulate=True)

    def uncount(self, drawn: Sequence[tuple[SamplingState, int]]) -> None:
        """Take back the count of tokens `record` counted that were never output (draws past a verified run of
        drafts), before the request's next draw."""
        picks = [(s.penalty_row, t) for s, t in drawn if s.penalty_row is not None]
        if picks:
            index = to_device([v for pair in picks for v in pair], torch.int64, self.device).view(-1, 2)
            minus = torch.full((len(picks),), -1.0, dtype=torch.float32, device=self.device)
            self.counts.index_put_((index[:, 0], index[:, 1]), minus, accumulate=True)

    def apply(
        self, logits: torch.Tensor, states: Sequence[SamplingState], before: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """[N, vocab] float32 -> penalised [N, vocab] float32, written into `logits` (rows with penalties).
        `before`: per row, tokens its draw follows in this step that no count holds yet (a verifying row's
        drafts before it): counted for that row as if output."""
        assert logits.dtype == torch.float32 and logits.shape[0] == len(states)
        picked = [(i, row, s.params) for i, s in enumerate(states) if (row := s.penalty_row) is not None]
        if not picked:
            return logits
        # One upload for every per-row number: batch row, table row, and the three penalties.
        packed = to_device(
            [[float(r), float(t), p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for r, t, p in picked],
            torch.float32,
            self.device,
        )  # [R, 5]
        row_index, table_index = packed[:, 0].long(), packed[:, 1].long()
        x = logits.index_select(0, row_index)  # [R, vocab]
        counts = self.counts.index_select(0, table_index)  # [R, vocab]
        if before is not None and any(before[i] for i, _, _ in picked):
            pending = [(k, t) for k, (i, _, _) in enumerate(picked) for t in before[i] if 0 <= t < self.vocab_size]
            index = to_device([v for pair in pending for v in pair], torch.int64, self.device).view(-1, 2)
            ones = torch.ones(len(pending), dtype=torch.float32, device=self.device)
            counts.index_put_((index[:, 0], index[:, 1]), ones, accumulate=True)
        seen = self.prompt_seen.index_select(0, table_index) | (counts > 0)
        penalty = packed[:, 2:3]
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        x = x - packed[:, 3:4] * counts - packed[:, 4:5] * (counts > 0)
        return logits.index_copy_(0, row_index, x)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros_like(self.prompt_seen)])
        self._free.extend(range(2 * old - 1, old - 1, -1))
