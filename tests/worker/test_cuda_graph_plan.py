"""The host side of CUDA-graph replay, on CPU: which sizes are captured, which steps replay and at what
padded size, and what padded rows hold (no KV write, one key, positions in range)."""

from __future__ import annotations

import torch

from asyncllm.executor.interface import ScheduledSeq, SchedulerOutput
from asyncllm.worker.cuda_graph import capture_sizes, is_decode_only
from asyncllm.worker.input_batch import InputBuffers


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(37) == [1, 2, 4, 8, 16, 32, 37]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]


def test_only_decode_steps_replay() -> None:
    decode = SchedulerOutput(seqs=[ScheduledSeq("a", [3], 5, [0, 1], True)])
    chunk = SchedulerOutput(seqs=[ScheduledSeq("a", [3, 4], 5, [0, 1], True)])
    middle = SchedulerOutput(seqs=[ScheduledSeq("a", [3], 5, [0, 1], False)])  # a one-token chunk, no sample
    assert is_decode_only(decode) and not is_decode_only(chunk) and not is_decode_only(middle)


def test_padded_rows_write_nothing_and_attend_one_key() -> None:
    buffers = InputBuffers(64, 8, 4, 4, torch.device("cpu"))
    step = SchedulerOutput(seqs=[ScheduledSeq("a", [11], 6, [2, 3], True), ScheduledSeq("b", [12], 9, [5, 6, 7], True)])
    x = buffers.prepare(step, pad_to=4)
    assert x.num_tokens == 4 and x.meta.num_seqs == 4
    assert x.input_ids.tolist() == [11, 12, 0, 0]
    assert x.positions.tolist() == [6, 9, 0, 0]
    assert x.meta.slot_mapping.tolist() == [3 * 4 + 2, 7 * 4 + 1, -1, -1]  # position 9: block_ids[2], row 1
    assert x.meta.seq_lens.tolist() == [7, 10, 1, 1]
    assert x.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert x.meta.block_tables[2:].abs().sum().item() == 0
    assert x.logits_indices.tolist() == [0, 1]  # only real rows sample
    again = buffers.prepare(SchedulerOutput(seqs=[ScheduledSeq("a", [13], 7, [2, 3], True)]))  # no padding
    assert again.num_tokens == 1 and again.meta.slot_mapping.tolist() == [3 * 4 + 3]
