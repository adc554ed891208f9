"""Preparing one step's model inputs into persistent buffers.

Host staging tensors (pinned on CUDA) are allocated once at their maximum size and filled through numpy
views; device tensors are filled by one non-blocking copy each. Fixed addresses are what CUDA graphs need
(a captured graph reads these very tensors), and no step allocates. A decode step replayed by a graph is
padded to the captured size: padded rows write no KV (slot -1) and attend to one key. A step that samples
nothing (a long prompt's middle chunks) ends without any host sync, so before refilling the host side we
wait on an event recorded after the previous step's copies: only for those copies, never for the forward
pass. Overlapped scheduling (wave two) double-buffers instead.
"""

from __future__ import annotations

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
    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        pin = device.type == "cuda"
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
        # Recorded after each step's uploads (CUDA only; one event, re-recorded every step).
        self._copies_done = torch.cuda.Event() if self.input_ids.dev is not self.input_ids.cpu else None
        self._copies_pending = False

    def prepare(self, scheduled: SchedulerOutput, pad_to: int | None = None) -> ModelInputs:
        """Fill and upload the step's inputs. `pad_to`: a decode-only step padded with dummy sequences to
        that many rows (a captured CUDA graph's size)."""
        if self._copies_done is not None and self._copies_pending:
            self._copies_done.synchronize()  # the host buffers are free to overwrite only once copied out
        bs = self.block_size
        ids, pos, slots = self.input_ids.np, self.positions.np, self.slot_mapping.np
        qsl, lens, tables, logit_rows = (
            self.query_start_loc.np,
            self.seq_lens.np,
            self.block_tables.np,
            self.logits_indices.np,
        )
        query_lens: list[int] = []
        seq_lens: list[int] = []
        t = 0
        num_sampling = 0
        qsl[0] = 0
        for i, seq in enumerate(scheduled.seqs):
            n = seq.num_tokens
            ids[t : t + n] = seq.input_token_ids
            p = np.arange(seq.start_pos, seq.start_pos + n, dtype=np.int64)
            pos[t : t + n] = p
            block_ids = np.asarray(seq.block_ids, dtype=np.int64)
            assert len(block_ids) <= self.max_blocks_per_seq, "block table wider than max_model_len allows"
            slots[t : t + n] = block_ids[p // bs] * bs + p % bs
            tables[i, : len(block_ids)] = block_ids
            tables[i, len(block_ids) :] = 0
            t += n
            qsl[i + 1] = t
            lens[i] = seq.seq_len
            query_lens.append(n)
            seq_lens.append(seq.seq_len)
            if seq.sample:
                logit_rows[num_sampling] = t - 1
                num_sampling += 1
        b = len(scheduled.seqs)
        if pad_to is not None and pad_to > b:
            assert t == b, "only decode-only steps are padded"
            ids[b:pad_to] = 0
            pos[b:pad_to] = 0
            slots[b:pad_to] = -1  # write no KV
            tables[b:pad_to] = 0
            lens[b:pad_to] = 1  # attend to one key: finite garbage in rows nobody reads
            qsl[b + 1 : pad_to + 1] = np.arange(b + 1, pad_to + 1)
            query_lens += [1] * (pad_to - b)
            seq_lens += [1] * (pad_to - b)
            b = t = pad_to
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
