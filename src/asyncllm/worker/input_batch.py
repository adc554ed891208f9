"""Preparing one step's model inputs into persistent buffers, and staging its attention plan beside them.

The per-token and per-sequence inputs are fixed regions of the step's `StepStaging` (pinned on CUDA):
written through numpy views, sent with everything else the step stages in one copy by `flush`. So is the
work list of a static attention plan (`work`: one fixed address for every bucket's plan). The block
table has a host/device pair of its own: a row is rewritten on the host only when its sequence or block
count changed, and only the rows changed since the last flush are copied. Fixed addresses are what CUDA
graphs need (a captured graph reads these very tensors), and no step allocates. A decode step replayed by a
graph is padded to the captured size: padded rows write no KV (slot -1) and attend to one key. Any other
step is padded to a captured token count with rows of no sequence (no KV write; nothing reads their
attention). The host side is rewritten only once the previous flush's copies have read it (the staging's
event: normally long done, so nothing waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.attention.backend import AttentionMetadata, AttentionPlan
from asyncllm.step import SchedulerOutput
from asyncllm.worker.step_staging import PrefixViews, StepStaging


@dataclass(frozen=True)
class WorkRoom:
    """Room for the attention plans' work lists (`AttentionPlan.work`): a fixed region for static plans (a
    captured graph reads it there), staging room for a step planned alone."""

    static: int = 0  # entries: the longest static plan's
    step: int = 0  # entries: the longest plan of one step within the step budget
    dtype: torch.dtype = torch.int32  # the backend's `work_dtype`


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the row of each sampling sequence's last token
    num_tokens: int
    # PLACEHOLDER inputs (overlapped scheduling): their rows, and the requests whose latest token fills them.
    placeholder_rows: list[int]
    placeholder_owners: list[str]


class _BlockTable:
    """The block table's host rows and their device twin (a separate buffer on CPU too), with the range of
    rows written since the last upload."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.cpu = torch.zeros(rows, width, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.np = self.cpu.numpy()
        self.dev = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._dirty = (rows, 0)  # [lo, hi): nothing yet
        self.view = PrefixViews(self.dev)  # view(n): the device table's first n rows

    def dirty(self, row: int) -> None:
        lo, hi = self._dirty
        self._dirty = (min(lo, row), max(hi, row + 1))

    def upload(self) -> None:
        """Copy the rows written since the last upload, without blocking the host."""
        lo, hi = self._dirty
        if lo < hi:
            self.dev[lo:hi].copy_(self.cpu[lo:hi], non_blocking=True)
        self._dirty = (self.cpu.shape[0], 0)


class InputBuffers:
    """Persistent host/device buffers for one step's inputs, refilled by `prepare` every step."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        work: WorkRoom | None = None,
    ) -> None:
        work = work or WorkRoom()
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        # What else a step stages beside its inputs: the sampler's seeds, offsets and temperatures, the
        # latest tokens' feed and record indices (int64, at most a few per sequence), with room to spare, and
        # the attention plan of a step planned alone.
        step_work = work.step * work.dtype.itemsize
        self.staging = StepStaging(device, dynamic_bytes=16 * 8 * (max_num_seqs + 16) + step_work)
        # Per-sequence regions first, then per-token ones. `work`: the attention work list of a static plan,
        # rewritten every step at its fixed address.
        self.query_start_loc = self.staging.region(max_num_seqs + 1, torch.int32)
        self.seq_lens = self.staging.region(max_num_seqs, torch.int32)
        self.work = self.staging.region(work.static, work.dtype)
        self.logits_indices = self.staging.region(max_num_seqs, torch.int64)
        self.input_ids = self.staging.region(max_num_tokens, torch.int64)
        self.positions = self.staging.region(max_num_tokens, torch.int64)
        self.slot_mapping = self.staging.region(max_num_tokens, torch.int64)
        self.block_tables = _BlockTable(max_num_seqs, max_blocks_per_seq, device)
        # Which sequence each block-table row holds and how many of its blocks are written, so a row is
        # rewritten only when that changes (a decode crosses a block boundary every block_size steps).
        self._row_owner: list[str | None] = [None] * max_num_seqs
        self._row_blocks = [0] * max_num_seqs
        self._row_of: dict[str, int] = {}  # the row each owner was last written to

    def prepare(
        self,
        scheduled: SchedulerOutput,
        pad_to: int | None = None,
        pad_tokens_to: int | None = None,
        pad_logits_to: int | None = None,
        flush: bool = True,
        verify_drafts: bool = True,
    ) -> ModelInputs:
        """Turn the step into its inputs, written straight into their staged regions, and, with `flush`, send
        them (callers that stage more for the same step pass flush=False and call `flush` once they are done).
        `pad_to`: a decode-only step padded with dummy sequences to that many rows (a captured CUDA graph's
        size). `pad_tokens_to`: any step padded with rows that belong to no sequence (a mixed-step graph's
        token count): they write no KV and nothing attends from them.
        `pad_logits_to`: `logits_indices` repeats its last row up to that many (the LM head's padded count).
        A sequence with drafts (`ScheduledSeq.num_drafts`) gets a logit row at each of its last 1 + k positions,
        or with `verify_drafts` False only the first of them (its drafts go unverified: none is accepted).

        One light pass over the sequences gathers Python lists, then each buffer gets one bulk write; a
        block-table row is rewritten only when its sequence or block count changed since the last step.
        """
        self.staging.begin(new_step=True)  # the host buffers are free to overwrite only once copied out
        # A preempted request comes back with other blocks; a finished one's id may be reused, and so may a
        # dummy's (warm-up's, capture's: never finished): none may inherit its old row.
        new = (n.request_id for n in scheduled.new_requests)
        for request_id in (*scheduled.preempted_request_ids, *scheduled.finished_request_ids, *new):
            row = self._row_of.pop(request_id, None)
            if row is not None and self._row_owner[row] == request_id:
                self._row_owner[row] = None
        bs = self.block_size
        id_list: list[int] = []
        pos_list: list[int] = []
        slot_list: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        fill_rows: list[int] = []
        fill_owners: list[str] = []
        t = 0
        for i, seq in enumerate(scheduled.seqs):
            ids, start, blocks = seq.input_token_ids, seq.start_pos, seq.block_ids
            n = len(ids)
            if seq.takes_previous_token:
                fill_rows.append(t + n - 1 - seq.num_drafts)
                fill_owners.append(seq.request_id)
            if n == 1:  # a decode (or a one-token chunk): plain ints beat numpy at this size
                id_list.append(ids[0])
                pos_list.append(start)
                slot_list.append(blocks[start // bs] * bs + start % bs)
            else:
                p = np.arange(start, start + n, dtype=np.int64)
                id_list += ids
                pos_list += p.tolist()
                slot_list += (np.asarray(blocks, dtype=np.int64)[p // bs] * bs + p % bs).tolist()
            self._set_table_row(i, seq.request_id, blocks)
            t += n
            query_lens.append(n)
            seq_lens.append(start + n)
            if seq.sample:
                k = seq.num_drafts
                if k and verify_drafts:
                    logit_rows += range(t - 1 - k, t)
                else:
                    logit_rows.append(t - 1 - k)
        b = len(scheduled.seqs)
        if pad_to is not None and pad_to > b:
            assert t == b, "only decode-only steps are padded"
            pad = pad_to - b
            id_list += [0] * pad
            pos_list += [0] * pad
            slot_list += [-1] * pad  # write no KV
            for i in range(b, pad_to):
                self._set_table_row(i, None, ())
            query_lens += [1] * pad
            seq_lens += [1] * pad  # attend to one key: finite garbage in rows nobody reads
            b = t = pad_to
        if pad_tokens_to is not None and pad_tokens_to > t:
            pad = pad_tokens_to - t
            id_list += [0] * pad
            pos_list += [0] * pad
            slot_list += [-1] * pad  # write no KV
            t = pad_tokens_to
        self.input_ids.put(id_list)
        self.positions.put(pos_list)
        self.slot_mapping.put(slot_list)
        qsl = self.query_start_loc.touch(b + 1)
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1:])
        self.seq_lens.put(seq_lens)
        if pad_logits_to is not None and pad_logits_to > len(logit_rows):
            logit_rows += [logit_rows[-1] if logit_rows else 0] * (pad_logits_to - len(logit_rows))
        self.logits_indices.put(logit_rows)
        num_sampling = len(logit_rows)
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc.view(b + 1),
            seq_lens=self.seq_lens.view(b),
            block_tables=self.block_tables.view(b),
            slot_mapping=self.slot_mapping.view(t),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_tables_cpu=self.block_tables.np,  # rows past b are other steps' (cascade planning reads b rows)
            block_size=bs,
        )
        inputs = ModelInputs(
            input_ids=self.input_ids.view(t),
            positions=self.positions.view(t),
            meta=meta,
            logits_indices=self.logits_indices.view(num_sampling),
            num_tokens=t,
            placeholder_rows=fill_rows,
            placeholder_owners=fill_owners,
        )
        if flush:
            self.flush()
        return inputs

    def holds_row(self, request_id: str) -> bool:
        """Whether a block-table row was written for `request_id` (one a later `prepare` must be told it left)."""
        return request_id in self._row_of

    def stage_plan(self, meta: AttentionMetadata, plan: AttentionPlan | None, static: bool) -> None:
        """Stage the attention plan's work list (a static plan's in the fixed `work` region, where its graph
        reads it) and bind the plan into `meta` for the forward pass."""
        if plan is not None:
            if static:
                self.work.put(plan.work)
                plan.bind(self.work.view(len(plan.work)))
            else:
                plan.bind(self.staging.stage(plan.work, self.work.dtype))
        meta.plan = plan

    def flush(self) -> None:
        """Send everything this step wrote or staged: the block-table rows that changed, then the staging's
        one copy (whose event covers both)."""
        self.block_tables.upload()
        self.staging.flush()

    def _set_table_row(self, row: int, owner: str | None, blocks: Sequence[int]) -> None:
        n = len(blocks)
        assert n <= self.max_blocks_per_seq, "block table wider than max_model_len allows"
        written = self._row_blocks[row]
        table = self.block_tables.np[row]
        if self._row_owner[row] == owner and written <= n:
            if written < n:
                table[written:n] = blocks[written:]  # the blocks allocated since the last step
                self.block_tables.dirty(row)
        else:
            table[:n] = blocks
            if written > n:
                table[n:written] = 0
            self.block_tables.dirty(row)
            self._row_owner[row] = owner
            if owner is not None:
                # One row per owner: the row it left (the batch shifts as requests ahead finish) is no longer
                # its own, or a later step placing it there again would keep that row's older blocks.
                left = self._row_of.get(owner)
                if left is not None and left != row and self._row_owner[left] == owner:
                    self._row_owner[left] = None
                self._row_of[owner] = row
        self._row_blocks[row] = n
