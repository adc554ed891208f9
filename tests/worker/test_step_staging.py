"""`StepStaging`: what a step writes reaches the device only at `flush`, in one copy of the written prefix;
fixed regions keep their device addresses; staged tensors are aligned and packed behind them."""

from __future__ import annotations

import pytest
import torch

from asyncllm.worker.step_staging import ALIGN, StepStaging

CPU = torch.device("cpu")


def test_writes_reach_the_device_only_at_flush() -> None:
    staging = StepStaging(CPU, dynamic_bytes=256)
    ids = staging.region(8, torch.int64)
    lens = staging.region(4, torch.int32)
    ids.put([5, 6, 7])
    lens.put([1, 2])
    staged = staging.stage([0.5, 1.5], torch.float32)
    assert ids.view(3).tolist() == [0, 0, 0], "the device side changed before the flush"
    staging.flush()
    assert ids.view(3).tolist() == [5, 6, 7]
    assert lens.view(2).tolist() == [1, 2]
    assert staged.tolist() == [0.5, 1.5]


def test_fixed_regions_keep_their_addresses_and_views() -> None:
    staging = StepStaging(CPU, dynamic_bytes=64)
    a = staging.region(3, torch.int32)
    b = staging.region(5, torch.int64)
    first = (a.dev.data_ptr(), b.dev.data_ptr())
    assert b.dev.data_ptr() % ALIGN == 0 and b.offset % ALIGN == 0
    assert a.view(2) is a.view(2), "a cached view is the same tensor (freeing one costs a GIL release)"
    for step in range(3):
        b.put([step] * 5)
        staging.stage([step], torch.int64)
        staging.flush()
        assert (a.dev.data_ptr(), b.dev.data_ptr()) == first
        assert b.view(5).tolist() == [step] * 5


def test_staged_tensors_are_aligned_packed_and_reset_every_step() -> None:
    staging = StepStaging(CPU, dynamic_bytes=256)
    staging.region(3, torch.int32)
    x = staging.stage([1, 2, 3], torch.int64)
    y = staging.stage([4.0], torch.float32)
    assert x.data_ptr() % ALIGN == 0 and y.data_ptr() % ALIGN == 0
    assert y.data_ptr() > x.data_ptr()
    staging.flush()
    assert x.tolist() == [1, 2, 3] and y.tolist() == [4.0]
    again = staging.stage([9, 9, 9], torch.int64)  # the next step starts packing from the front again
    assert again.data_ptr() == x.data_ptr()


def test_a_full_staging_area_falls_back_to_an_immediate_upload() -> None:
    staging = StepStaging(CPU, dynamic_bytes=16)
    staging.region(2, torch.int64)
    fits = staging.stage([1, 2], torch.int64)
    spill = staging.stage(list(range(10)), torch.int64)  # 80 bytes: more than the area holds
    assert spill.tolist() == list(range(10)), "an upload that did not fit is there at once"
    staging.flush()
    assert fits.tolist() == [1, 2]


def test_bad_layout_and_overflow_are_named() -> None:
    staging = StepStaging(CPU, dynamic_bytes=16)
    region = staging.region(2, torch.int32)
    with pytest.raises(ValueError, match="overflow a staged region of 2"):
        region.put([1, 2, 3])
    region.put([1, 2])
    staging.flush()
    with pytest.raises(RuntimeError, match="declared before"):
        staging.region(1, torch.int32)


def test_a_step_that_failed_before_its_flush_leaves_nothing_behind() -> None:
    """A step that raised between its writes and its flush: the next step starts its packing afresh."""
    staging = StepStaging(CPU, dynamic_bytes=64)
    staging.region(2, torch.int64)
    first = staging.stage([1, 2], torch.int64)
    staging.stage([3, 4], torch.int64)  # ... and the step fails here, never flushed
    staging.begin(new_step=True)
    again = staging.stage([5, 6], torch.int64)
    assert again.data_ptr() == first.data_ptr()
    staging.flush()
    assert again.tolist() == [5, 6]


def test_buffers_first_used_in_inference_mode_take_copies_outside_it() -> None:
    staging = StepStaging(CPU, dynamic_bytes=64)
    region = staging.region(4, torch.int64)
    with torch.inference_mode():
        region.put([1, 2])
        staging.flush()
    region.put([3, 4])  # would raise "Inplace update to inference tensor outside InferenceMode"
    staging.flush()
    assert region.view(2).tolist() == [3, 4]
