"""`DraftModel`: speculative decoding's "draft_model" method, the runner's side. A smaller model with the
target's vocabulary proposes each speculative request's next tokens after every step of it; the core hands
them back as the drafts of the request's next decode, which the target verifies (`spec_verify.py`).

Its KV cache is its own tensors under the target's block ids: the block manager allocates once for both. To
keep it complete the draft runs over every token the target computes, in the same step, with the same inputs
(`follow`: prompt chunks, drafts, every request's, so a prefix cached by one request serves the draft of the
next). After the step's tokens are read, `propose` runs it greedily `num_tokens` times, batched over the
speculative rows, from each row's last token (its accepted run's last, verifying drafts). Those steps write
the draft's KV past the request's tokens: only as far as the request's blocks reach (the scheduler reserves
the room: core/spec/draft_proposals.py), so no write lands in another request's block; positions whose
token changes are rewritten by a later `follow`, as the target rewrites rejected drafts.

A step with speculative rows is read on the host before `submit` returns (the proposals need its tokens), and
the draft's decode steps run eagerly; a step with constrained rows proposes nothing (its tokens go to the
grammar when the core reads it, in order). Knows nothing of the core's requests beyond the step's plain data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from asyncllm.attention.backend import AttentionBackend, PlanBounds
from asyncllm.models.base import CausalLM
from asyncllm.step import ModelRunnerOutput, ScheduledSeq, SchedulerOutput, StepResult
from asyncllm.worker.draft_steps import drafts_by_row, not_drafting, with_drafts
from asyncllm.worker.input_batch import InputBuffers, ModelInputs, WorkRoom
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache


@dataclass(frozen=True)
class LoadedDraft:
    """The draft model loaded (worker/draft_setup.py), before its cache is allocated."""

    model: CausalLM
    backend: AttentionBackend
    kv_spec: KVCacheSpec  # its cache's layers and heads, one block per target block id
    num_tokens: int  # num_speculative_tokens: drafts proposed after each step


@dataclass(frozen=True)
class _Row:
    """A speculative row to draft for: `room` tokens from `token`, the request's last, at `position`."""

    index: int  # its sample index in the step
    request_id: str
    token: int
    position: int
    block_ids: list[int]
    room: int


class DraftModel:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        buffers: InputBuffers,
        num_tokens: int,
        max_seq_len: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.buffers = buffers  # the draft's decode steps' own inputs (the target's hold the step in flight)
        self.num_tokens = num_tokens
        self.max_seq_len = max_seq_len
        self._speculative: set[str] = set()  # live requests the core lets speculate (NewRequestData.speculative)
        self._gone: list[str] = []  # preempted or finished since the draft's last decode step (their table rows)

    @classmethod
    def create(
        cls, loaded: LoadedDraft, num_blocks: int, max_num_seqs: int, max_seq_len: int, device: torch.device
    ) -> DraftModel:
        """The draft's cache (`num_blocks`, as the target's) and the inputs of its decode steps."""
        spec = loaded.kv_spec
        bounds = PlanBounds(max_num_seqs, max_num_seqs, max_seq_len)
        room = WorkRoom(step=loaded.backend.work_size(bounds), dtype=loaded.backend.work_dtype)
        max_blocks = -(-max_seq_len // spec.block_size)
        buffers = InputBuffers(max_num_seqs, max_num_seqs, max_blocks, spec.block_size, device, room)
        caches = allocate_kv_cache(spec, num_blocks, device)
        return cls(loaded.model, loaded.backend, caches, buffers, loaded.num_tokens, max_seq_len)

    def follow(self, scheduled: SchedulerOutput, x: ModelInputs) -> None:
        """The draft's KV for the step's tokens: its forward pass over the target's inputs (padding rows write
        nothing), with a plan of its own backend (its heads may differ)."""
        for new in scheduled.new_requests:  # (the finished ones went with the runner's `forget`)
            if new.speculative:
                self._speculative.add(new.request_id)
        self._gone += [r for r in scheduled.preempted_request_ids if self.buffers.holds_row(r)]
        meta = dataclasses.replace(x.meta, plan=None)
        self.backend.plan_and_upload(meta)
        self.model(x.input_ids, x.positions, self.kv_caches, meta)

    def forget(self, request_ids: list[str]) -> None:
        """Requests the runner drops: finished (the step's `finished_request_ids`), or warm-up's."""
        self._gone += [r for r in request_ids if self.buffers.holds_row(r)]  # at most a row each: bounded
        self._speculative.difference_update(request_ids)

    def propose(self, scheduled: SchedulerOutput, step: StepResult) -> StepResult:
        """`step`, with the draft's proposals for its speculative rows (`ModelRunnerOutput.drafts`): read now
        where it has such rows and speculation is not paused, else handed back as it is."""
        sampled = [seq for seq in scheduled.seqs if seq.sample]
        if not scheduled.propose_drafts or not any(seq.request_id in self._speculative for seq in sampled):
            return step
        return with_drafts(step, lambda out: self._rows(sampled, out), self._draft)

    def _rows(self, sampled: list[ScheduledSeq], out: ModelRunnerOutput) -> list[_Row]:
        """The rows to draft for, those with the most room first: speculative, with a token this step (not
        failed, not sitting out) that is the request's last (no forced run after it)."""
        skip = not_drafting(out)
        accepted = out.accepted or {}
        bs = self.buffers.block_size
        rows: list[_Row] = []
        for index, seq in enumerate(sampled):
            if seq.request_id not in self._speculative or index in skip:
                continue
            run = accepted.get(index, ())
            token = run[-1] if run else out.sampled_token_ids[index]
            # The row's first draw follows its last known input, the drafts after it; then the accepted run.
            position = seq.start_pos + seq.num_tokens - seq.num_drafts + len(run)
            room = min(self.num_tokens, len(seq.block_ids) * bs - position, self.max_seq_len - position)
            if room > 0:
                rows.append(_Row(index, seq.request_id, token, position, seq.block_ids, room))
        rows.sort(key=lambda row: -row.room)
        return rows

    def _draft(self, rows: list[_Row]) -> list[list[int]]:
        """Greedy decode steps of the draft over `rows` (sorted by room, so the rows still drafting at step j are
        a prefix): each step's tokens feed the next on the device; one read at the end."""
        steps: list[torch.Tensor] = []
        previous: torch.Tensor | None = None
        for j in range(rows[0].room):
            active = [row for row in rows if row.room > j]
            seqs = [ScheduledSeq(r.request_id, [r.token], r.position + j, r.block_ids, True) for r in active]
            gone, self._gone = self._gone, []
            x = self.buffers.prepare(SchedulerOutput(seqs, preempted_request_ids=gone), flush=False)
            self.buffers.stage_plan(x.meta, self.backend.plan(x.meta), static=False)
            self.buffers.flush()
            if previous is not None:  # the tokens the last step drafted, fed on the device
                x.input_ids.copy_(previous[: len(active)])
            hidden = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)  # [n, hidden]
            previous = self.model.compute_logits(hidden[x.logits_indices]).argmax(dim=-1)  # [n]
            steps.append(previous)
        return drafts_by_row(steps, len(rows))
