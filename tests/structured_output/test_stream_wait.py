"""The device's stream waits for a word of host memory (`StreamWaiter`, the grammar rows' flags): work queued
after the wait runs only once the word reaches the value, counted modulo 2**32."""

from __future__ import annotations

import time

import pytest
import torch

from asyncllm.structured_output.host_rows import RowsLayout, RowsSegment
from asyncllm.structured_output.stream_wait import StreamWaiter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _queued_copy(waiter: StreamWaiter, segment: RowsSegment, value: int) -> tuple[torch.Tensor, torch.cuda.Event]:
    src = torch.arange(1, 9, device="cuda", dtype=torch.float32)
    dst = torch.zeros(8, device="cuda")
    waiter.wait(waiter.device_address(segment.flag_address(1)), value)
    dst.copy_(src)
    done = torch.cuda.Event()
    done.record()
    return dst, done


def test_work_after_the_wait_runs_once_the_flag_reaches_its_value() -> None:
    segment = RowsSegment(RowsLayout(2, 4, 8))
    try:
        assert segment.pin()
        waiter = StreamWaiter.open(segment.flag_address(0))
        assert waiter is not None
        dst, done = _queued_copy(waiter, segment, 3)
        time.sleep(0.2)
        assert not done.query()
        segment.flags[1] = 2  # below the value
        time.sleep(0.1)
        assert not done.query()
        segment.flags[0] = 3  # another set's flag
        time.sleep(0.1)
        assert not done.query()
        segment.flags[1] = 4  # past it: reached
        done.synchronize()
        assert dst.tolist() == list(range(1, 9))
        # Counted modulo 2**32: a value past the wrap is still ahead of a flag just below it.
        segment.flags[1] = 0xFFFFFFFF
        dst, done = _queued_copy(waiter, segment, 1)
        time.sleep(0.1)
        assert not done.query()
        segment.flags[1] = 1
        done.synchronize()
        assert dst.tolist() == list(range(1, 9))
    finally:
        segment.flags[:] = 0x7FFFFFFF  # a failed assert must not leave the stream waiting (close synchronizes)
        segment.close()
