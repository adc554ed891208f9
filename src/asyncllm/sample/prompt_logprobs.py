"""Prompt logprobs (`SamplingParams.prompt_logprobs`): which rows of a step's hidden states score which prompt
tokens (`PromptScorer.plan`), and the scoring (`score_prompts`): the LM head over those rows in bounded
slices, log_softmax in float32, each row's next prompt token and the top alternatives, packed into one tensor
that reaches the host with the step's tokens.

Position p's logits score prompt token p + 1: a chunk's last row scores the next chunk's first token (the
whole prompt is known from the start), and the prompt's last position, whose logits draw the first token,
scores nothing. Each position is scored once: a request recomputing its prompt after a preemption is not
scored again. A step without such a request costs nothing here. Knows nothing of scheduling beyond the step's
plain data, nor of how tokens are drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncllm.layers.host_copy import to_device
from asyncllm.sample.logprobs import pack_logprobs, to_pinned, unpack
from asyncllm.step import SchedulerOutput


@dataclass(frozen=True)
class PromptPlan:
    """One step's scoring, as host data: for each request (in step order) its rows, consecutive in `rows`."""

    request_ids: list[str]
    counts: list[int]  # rows each request scores
    num_alternatives: list[int]  # each request's `prompt_logprobs`
    rows: list[int]  # rows of the step's hidden states, request by request
    targets: list[int]  # the prompt token each row scores: the one after its position


@dataclass
class PromptLogprobsOutput:
    plan: PromptPlan
    num_top: int
    packed: torch.Tensor  # [len(plan.rows), 2 + 2 * num_top] float64 (`pack_logprobs`)

    def to_host(self) -> PromptLogprobsOutput:
        """Start the copy to the host; read with `to_dicts` after a sync."""
        self.packed = to_pinned(self.packed)
        return self

    def to_dicts(self) -> dict[str, list[dict[int, float]]]:
        """Request id -> {token id: logprob} per scored prompt token: that token and its top alternatives."""
        values = self.packed.tolist()
        plan, out, at = self.plan, {}, 0
        for request_id, count, k in zip(plan.request_ids, plan.counts, plan.num_alternatives):
            out[request_id] = [unpack(row, self.num_top, k) for row in values[at : at + count]]
            at += count
        return out


@dataclass
class _Prompt:
    token_ids: list[int]
    num_alternatives: int
    next_pos: int = 0  # the first position not scored yet


class PromptScorer:
    """The prompts still being scored, by request id; falsy when there are none (the usual case)."""

    def __init__(self) -> None:
        self._pending: dict[str, _Prompt] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, request_id: str, prompt_token_ids: list[int], num_alternatives: int) -> None:
        if len(prompt_token_ids) > 1:  # a one-token prompt has nothing to score (its one entry is None)
            self._pending[request_id] = _Prompt(prompt_token_ids, num_alternatives)

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def plan(self, scheduled: SchedulerOutput) -> PromptPlan | None:
        """The rows of this step that score a prompt token not scored before (None: there are none). A prompt
        whose last scored position is planned here leaves the scorer."""
        pending = self._pending
        plan = PromptPlan([], [], [], [], [])
        done = []
        t = 0  # the row of each sequence's first input: sequences are laid out in order (`InputBuffers.prepare`)
        for seq in scheduled.seqs:
            prompt = pending.get(seq.request_id)
            if prompt is not None:
                start, last = seq.start_pos, len(prompt.token_ids) - 1
                lo, hi = max(start, prompt.next_pos), min(seq.seq_len, last)
                if lo < hi:
                    assert start <= prompt.next_pos, "a request scoring its prompt computes every position"
                    plan.request_ids.append(seq.request_id)
                    plan.counts.append(hi - lo)
                    plan.num_alternatives.append(prompt.num_alternatives)
                    plan.rows.extend(range(t + lo - start, t + hi - start))
                    plan.targets.extend(prompt.token_ids[lo + 1 : hi + 1])
                    prompt.next_pos = hi
                if prompt.next_pos == last:
                    done.append(seq.request_id)
            t += seq.num_tokens
        for request_id in done:
            del pending[request_id]
        return plan if plan.rows else None


def score_prompts(
    plan: PromptPlan,
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    max_rows: int,
    pad_rows: Callable[[int], int] | None = None,
) -> PromptLogprobsOutput:
    """Score `plan`'s rows of `hidden` ([T, hidden]) without waiting for the device: `compute_logits` (the LM
    head, [N, hidden] -> [N, vocab]) runs on at most `max_rows` rows at a time, so memory stays that of a
    step's sampling however long the prompt; `pad_rows(r)`: the row count to run r rows at (repeating the
    last), the counts the LM head was warmed up at."""
    device = hidden.device
    rows = to_device(plan.rows, torch.int64, device)  # [R]
    targets = to_device(plan.targets, torch.int64, device).unsqueeze(1)  # [R, 1]
    num_top = max(plan.num_alternatives)
    parts = []
    for start in range(0, len(plan.rows), max_rows):
        index = rows[start : start + max_rows]
        r = index.shape[0]
        padded = pad_rows(r) if pad_rows is not None else r
        if padded > r:
            index = torch.cat([index, index[-1:].expand(padded - r)])
        logits = compute_logits(hidden.index_select(0, index))[:r]  # [r, vocab]
        logprobs = logits.float().log_softmax(dim=-1)
        num_top = min(num_top, logprobs.shape[1])
        parts.append(pack_logprobs(logprobs, targets[start : start + r], num_top))
    packed = parts[0] if len(parts) == 1 else torch.cat(parts)
    return PromptLogprobsOutput(plan, num_top, packed)
