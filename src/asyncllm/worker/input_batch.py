"""Preparing one step's model inputs into persistent buffers.

Host staging tensors (pinned on CUDA) are allocated once at their maximum size and filled through numpy
views; device tensors are filled by one non-blocking copy each. Fixed addresses are what CUDA graphs need
(a captured graph reads these very tensors), and no step allocates. A decode step replayed by a graph is
padded to the captured size: padded rows write no KV (slot -1) and attend to one key. Any other step is
padded to a captured token count with rows of no sequence (no KV write; nothing reads their attention).
A step that samples nothing (a long prompt's middle chunks) ends without any host sync, so before refilling
the host side we wait on an event recorded after the previous step's copies: only for those copies, never
for the forward pass. Overlapped scheduling (wave two) double-buffers instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.executor.interface import SchedulerOutput


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the row of each sampling sequence's last token
    num_tokens: int


class _Pair:
    """A host staging tensor and its device twin of the same shape."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool) -> None:
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.dev = torch.zeros(shape, dtype=dtype, device=device) if device.type != "cpu" else self.cpu

    def upload(self, n: int) -> torch.Tensor:
        """Device view of the first n rows, copied without blocking the host."""
        if self.dev is self.cpu:
            return self.cpu[:n]
        dst = self.dev[:n]
        dst.copy_(self.cpu[:n], non_blocking=True)
        return dst


class InputBuffers:
    """Persistent host/device buffers for one step's inputs, refilled by `prepare` every step."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        pin = device.type == "cuda"
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = _Pair((max_num_tokens,), torch.int64, device, pin)
        self.positions = _Pair((max_num_tokens,), torch.int64, device, pin)
        self.slot_mapping = _Pair((max_num_tokens,), torch.int64, device, pin)
        self.query_start_loc = _Pair((max_num_seqs + 1,), torch.int32, device, pin)
        self.seq_lens = _Pair((max_num_seqs,), torch.int32, device, pin)
        self.block_tables = _Pair((max_num_seqs, max_blocks_per_seq), torch.int32, device, pin)
        self.logits_indices = _Pair((max_num_seqs,), torch.int64, device, pin)
        # Which sequence each block-table row holds and how many of its blocks are written, so a row is
        # rewritten only when that changes (a decode crosses a block boundary every block_size steps).
        self._row_owner: list[str | None] = [None] * max_num_seqs
        self._row_blocks = [0] * max_num_seqs
        self._row_of: dict[str, int] = {}  # the row each owner was last written to
        # Recorded after each step's uploads (CUDA only; one event, re-recorded every step).
        self._copies_done = torch.cuda.Event() if self.input_ids.dev is not self.input_ids.cpu else None
        self._copies_pending = False

    def prepare(
        self,
        scheduled: SchedulerOutput,
        pad_to: int | None = None,
        pad_tokens_to: int | None = None,
        pad_logits_to: int | None = None,
    ) -> ModelInputs:
        """Fill and upload the step's inputs. `pad_to`: a decode-only step padded with dummy sequences to
        that many rows (a captured CUDA graph's size). `pad_tokens_to`: any step padded with rows that belong
        to no sequence (a mixed-step graph's token count): they write no KV and nothing attends from them.
        `pad_logits_to`: `logits_indices` repeats its last row up to that many (the LM head's padded count).

        One light pass over the sequences gathers Python lists, then each buffer gets one bulk write; a
        block-table row is rewritten only when its sequence or block count changed since the last step.
        """
        if self._copies_done is not None and self._copies_pending:
            self._copies_done.synchronize()  # the host buffers are free to overwrite only once copied out
        # A preempted request comes back with other blocks; a finished one's id may be reused: neither may
        # inherit its old row.
        for request_id in (*scheduled.preempted_request_ids, *scheduled.finished_request_ids):
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
        t = 0
        for i, seq in enumerate(scheduled.seqs):
            n, start, blocks = len(seq.input_token_ids), seq.start_pos, seq.block_ids
            if n == 1:  # a decode (or a one-token chunk): plain ints beat numpy at this size
                id_list.append(seq.input_token_ids[0])
                pos_list.append(start)
                slot_list.append(blocks[start // bs] * bs + start % bs)
            else:
                p = np.arange(start, start + n, dtype=np.int64)
                id_list += seq.input_token_ids
                pos_list += p.tolist()
                slot_list += (np.asarray(blocks, dtype=np.int64)[p // bs] * bs + p % bs).tolist()
            self._set_table_row(i, seq.request_id, blocks)
            t += n
            query_lens.append(n)
            seq_lens.append(start + n)
            if seq.sample:
                logit_rows.append(t - 1)
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
        self.input_ids.np[:t] = id_list
        self.positions.np[:t] = pos_list
        self.slot_mapping.np[:t] = slot_list
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1 : b + 1])
        self.seq_lens.np[:b] = seq_lens
        if pad_logits_to is not None and pad_logits_to > len(logit_rows):
            logit_rows += [logit_rows[-1] if logit_rows else 0] * (pad_logits_to - len(logit_rows))
        self.logits_indices.np[: len(logit_rows)] = logit_rows
        num_sampling = len(logit_rows)
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc.upload(b + 1),
            seq_lens=self.seq_lens.upload(b),
            block_tables=self.block_tables.upload(b),
            slot_mapping=self.slot_mapping.upload(t),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        inputs = ModelInputs(
            input_ids=self.input_ids.upload(t),
            positions=self.positions.upload(t),
            meta=meta,
            logits_indices=self.logits_indices.upload(num_sampling),
            num_tokens=t,
        )
        if self._copies_done is not None:
            self._copies_done.record()
            self._copies_pending = True
        return inputs

    def _set_table_row(self, row: int, owner: str | None, blocks: Sequence[int]) -> None:
        n = len(blocks)
        assert n <= self.max_blocks_per_seq, "block table wider than max_model_len allows"
        written = self._row_blocks[row]
        table = self.block_tables.np[row]
        if self._row_owner[row] == owner and written <= n:
            if written < n:
                table[written:n] = blocks[written:]  # the blocks allocated since the last step
        else:
            table[:n] = blocks
            if written > n:
                table[n:written] = 0
            self._row_owner[row] = owner
            if owner is not None:
                self._row_of[owner] = row
        self._row_blocks[row] = n
