"""`Eagle3Drafter`: speculative decoding's "eagle3" method, the runner's side. An EAGLE-3 head (models/eagle3.py)
proposes each speculative request's next tokens after every step of it from the target's own hidden states;
the core hands them back as the drafts of the request's next decode, which the target verifies
(`spec_verify.py`), exactly as a draft model's (worker/draft_model.py, whose plumbing this shares).

The head's KV at position i is computed from the target's hidden states at i and the token at i + 1, so it
trails the target by one token. `follow` (after the target's forward pass is launched) computes it for every
position of the step's speculative sequences whose next token is an input of the step already (a prompt
chunk's last takes the prompt's next token); `propose` (once the step's tokens are read) computes the rest,
up to the request's last accepted token, the first draft coming from the last of them, then drafts greedily
`num_tokens - 1` more, each from the head's own pre-norm output at the position before. Those decode steps
write the head's KV past the request's tokens, as far as its blocks reach (the scheduler reserves the room:
core/spec/draft_proposals.py); positions whose token changes are rewritten by a later step.

A step with constrained rows proposes nothing (as a draft model's) and leaves those rows' last positions
without the head's KV: later drafts are only less often accepted, never wrong (verification is exact). So
does a step while speculation pauses (`SchedulerOutput.propose_drafts`: many running requests), for its rows'
last positions.
Knows nothing of the core's requests beyond the step's plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend, PlanBounds
from asyncllm.models.aux_hidden import AuxHidden
from asyncllm.models.eagle3 import Eagle3Head
from asyncllm.step import ModelRunnerOutput, ScheduledSeq, SchedulerOutput, StepResult
from asyncllm.worker.draft_steps import drafts_by_row, not_drafting, with_drafts
from asyncllm.worker.input_batch import InputBuffers, ModelInputs, WorkRoom
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache


@dataclass(frozen=True)
class LoadedEagle3:
    """The head loaded (worker/eagle3_setup.py), before its cache is allocated."""

    head: Eagle3Head
    embed: nn.Module  # the head's own embedding, or the target's
    backend: AttentionBackend
    kv_spec: KVCacheSpec  # its one layer's cache, one block per target block id
    num_tokens: int  # num_speculative_tokens: drafts proposed after each step
    aux: AuxHidden  # where the target's forward pass copies the hidden states the head reads
    max_tokens: int  # max_num_batched_tokens: the most rows one head pass takes


@dataclass(frozen=True)
class _Row:
    """A speculative row to draft for: its accepted `run` (tokens at positions first + 1 ...), whose hidden
    states are the target's rows `aux_row`...; `room` drafts fit its blocks."""

    index: int  # its sample index in the step
    request_id: str
    run: list[int]
    first: int  # the position of the row's last input (its first draw follows it)
    aux_row: int
    block_ids: list[int]
    room: int


class Eagle3Drafter:
    def __init__(
        self,
        loaded: LoadedEagle3,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        buffers: InputBuffers,
        max_seq_len: int,
    ) -> None:
        self.head = loaded.head
        self.embed = loaded.embed
        self.backend = loaded.backend
        self.aux = loaded.aux
        self.kv_cache = kv_caches[0]
        self.buffers = buffers  # the head's passes' own inputs (the target's hold the step in flight)
        self.num_tokens = loaded.num_tokens
        self.max_seq_len = max_seq_len
        self._prompts: dict[str, list[int]] = {}  # live speculative requests (NewRequestData.speculative)
        self._gone: list[str] = []  # preempted or finished since the head's last pass (their table rows)

    @classmethod
    def create(
        cls, loaded: LoadedEagle3, num_blocks: int, max_num_seqs: int, max_seq_len: int, device: torch.device
    ) -> Eagle3Drafter:
        spec = loaded.kv_spec
        rows = max(loaded.max_tokens, max_num_seqs)
        room = WorkRoom(
            step=loaded.backend.work_size(PlanBounds(rows, max_num_seqs, max_seq_len)), dtype=loaded.backend.work_dtype
        )
        max_blocks = -(-max_seq_len // spec.block_size)
        buffers = InputBuffers(rows, max_num_seqs, max_blocks, spec.block_size, device, room)
        return cls(loaded, allocate_kv_cache(spec, num_blocks, device), buffers, max_seq_len)

    def follow(self, scheduled: SchedulerOutput, x: ModelInputs) -> None:
        """The head's KV at the step's positions whose next token is already known (see the module's doc)."""
        for new in scheduled.new_requests:  # (the finished ones went with the runner's `forget`)
            if new.speculative:
                self._prompts[new.request_id] = new.prompt_token_ids
        self._gone += [r for r in scheduled.preempted_request_ids if self.buffers.holds_row(r)]
        seqs: list[ScheduledSeq] = []
        sources: list[int] = []  # each head row's target row (its hidden states)
        nexts: list[int] = []  # each head row's next token: a target row (< T), or T + its place in `tail`
        tail: list[int] = []
        offset = 0
        for seq in scheduled.seqs:
            n, start = seq.num_tokens, seq.start_pos
            prompt = self._prompts.get(seq.request_id)
            if prompt is not None:
                m = n - seq.num_drafts - 1 if seq.sample else n - 1  # rows whose next token is an input
                if not seq.sample and start + n < len(prompt):  # a prompt chunk's last: the prompt's next token
                    tail.append(prompt[start + n])
                    m += 1
                if m > 0:
                    seqs.append(ScheduledSeq(seq.request_id, [0] * m, start, seq.block_ids, False))
                    sources += range(offset, offset + m)
                    nexts += range(offset + 1, offset + min(m, n - 1) + 1)
                    if m == n:
                        nexts.append(x.num_tokens + len(tail) - 1)
            offset += n
        if not seqs:
            return
        device = x.input_ids.device
        pool = torch.cat([x.input_ids[: x.num_tokens], torch.tensor(tail, dtype=torch.int64, device=device)])
        hx = self._prepare(seqs)
        hx.input_ids.copy_(pool[torch.tensor(nexts, device=device)])
        self._pass(hx, torch.tensor(sources, device=device))

    def forget(self, request_ids: list[str]) -> None:
        """Requests the runner drops: finished (the step's `finished_request_ids`), or warm-up's."""
        self._gone += [r for r in request_ids if self.buffers.holds_row(r)]  # at most a row each: bounded
        for request_id in request_ids:
            self._prompts.pop(request_id, None)

    def propose(self, scheduled: SchedulerOutput, step: StepResult) -> StepResult:
        """`step`, with the head's proposals for its speculative rows (`ModelRunnerOutput.drafts`): read now
        where it has such rows and speculation is not paused, else handed back as it is."""
        speculative = any(seq.sample and seq.request_id in self._prompts for seq in scheduled.seqs)
        if not scheduled.propose_drafts or not speculative:
            return step
        return with_drafts(step, lambda out: self._rows(scheduled, out), self._draft)

    def _rows(self, scheduled: SchedulerOutput, out: ModelRunnerOutput) -> list[_Row]:
        """The rows to draft for, those with the most room first: speculative, with a token this step (not
        failed, not sitting out) that is the request's last (no forced run after it)."""
        skip = not_drafting(out)
        accepted = out.accepted or {}
        bs = self.buffers.block_size
        rows: list[_Row] = []
        offset, index = 0, 0
        for seq in scheduled.seqs:
            n = seq.num_tokens
            if seq.sample:
                if seq.request_id in self._prompts and index not in skip:
                    # The step's token, then the tokens it accepted after it (`accepted` leaves the first out).
                    run = [out.sampled_token_ids[index], *accepted.get(index, ())]
                    last = n - seq.num_drafts - 1  # the row of the last input: the run's tokens follow it
                    first = seq.start_pos + last
                    end = min(len(seq.block_ids) * bs, self.max_seq_len)  # positions the head may write below
                    room = min(self.num_tokens, end - (first + len(run)) + 1)
                    rows.append(_Row(index, seq.request_id, run, first, offset + last, seq.block_ids, room))
                index += 1
            offset += n
        rows.sort(key=lambda row: -row.room)
        return rows

    def _draft(self, rows: list[_Row]) -> list[list[int]]:
        """The head over each row's accepted run (its KV, and the first draft from the run's last token), then
        greedy steps over the rows still drafting (sorted by room: a prefix); each step's tokens and pre-norm
        states feed the next on the device; one read at the end."""
        device = self.aux.buffer.device
        seqs = [ScheduledSeq(r.request_id, r.run, r.first, r.block_ids, True) for r in rows]
        sources = [r.aux_row + i for r in rows for i in range(len(r.run))]
        hx = self._prepare(seqs)
        normed, hidden = self._pass(hx, torch.tensor(sources, device=device))
        last = hx.logits_indices[: len(rows)]
        tokens, hidden = self.head.draft(normed[last]), hidden[last]  # [R], [R, hidden]
        steps = [tokens]
        for j in range(1, rows[0].room):
            active = [row for row in rows if row.room > j]
            start = [row.first + len(row.run) + j - 1 for row in active]  # draft j + 1 follows draft j there
            hx = self._prepare([ScheduledSeq(r.request_id, [0], s, r.block_ids, True) for r, s in zip(active, start)])
            hx.input_ids.copy_(tokens[: len(active)])
            normed, hidden = self.head(
                self.embed(hx.input_ids), hidden[: len(active)], hx.positions, self.kv_cache, hx.meta
            )
            tokens = self.head.draft(normed)
            steps.append(tokens)
        return drafts_by_row(steps, len(rows))

    def _prepare(self, seqs: list[ScheduledSeq]) -> ModelInputs:
        """The inputs and attention plan of one head pass over `seqs`, uploaded."""
        gone, self._gone = self._gone, []
        x = self.buffers.prepare(SchedulerOutput(seqs, preempted_request_ids=gone), flush=False)
        self.buffers.stage_plan(x.meta, self.backend.plan(x.meta), static=False)
        self.buffers.flush()
        return x

    def _pass(self, x: ModelInputs, sources: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over `x`, its hidden inputs `fc` of the target's copied states at rows `sources`."""
        hidden = self.head.combine(self.aux.buffer.index_select(0, sources))  # [T, hidden]
        normed, pre = self.head(self.embed(x.input_ids), hidden, x.positions, self.kv_cache, x.meta)
        return normed, pre
