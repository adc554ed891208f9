"""`StepStaging`: everything a step sends to the device, in one host-to-device copy.

Three words, one meaning each, across the worker, the sampler and the attention backends:
- prepare: turn the step's `SchedulerOutput` into host data (`InputBuffers.prepare`; the sampler's draw
  parameters, the attention plan's work list and the latest tokens' indices are made alongside it);
- stage: write host data into this step's pinned buffer (`StagedRegion.put`, `StepStaging.stage`), which
  only the worker does: the sampler and the backends hand it plain lists;
- flush: the step's one copy of what was staged to the device (`flush`).

Why one copy: each torch call made from Python gives up the GIL and has to take it back. The step thread
shares the GIL with the event loop, which runs hundreds of consumers' Python between two steps, so every
such call is a chance to wait for the loop; and each small copy on the device's stream has its own latency.

A host buffer (pinned on CUDA) and its device twin are allocated once. The front of the buffer holds fixed
regions, declared before first use (`region`), at fixed device addresses: CUDA graphs read them. Behind
them, each step packs whatever else it uploads (`stage`), at offsets that may change from step to step.
Writers fill host memory through numpy (no torch call); `flush` sends everything written since the last
flush in one non-blocking copy of the buffer's used prefix; the device reads a region or a staged tensor
only in work queued after that flush. Before the host is written again, the first write of the next step
waits for that copy to have read it (normally long done: an event query, no wait and no GIL release).

On CPU the device twin is a separate buffer too and `flush` copies into it, so CPU tests catch a read
before the flush exactly as the GPU would.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from asyncllm.layers.host_copy import to_device

ALIGN = 16  # bytes: every region and staged tensor starts 16-byte aligned (Triton specialises on it)
_MAX_CACHED_VIEWS = 4096  # sizes a `PrefixViews` keeps


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PrefixViews:
    """The first n rows of a persistent tensor, as the same view object every time: on the step thread every
    tensor freed is a GIL release (torch >= 2.10). Up to a few thousand sizes are kept; others are made anew."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._views: dict[int, torch.Tensor] = {}

    def __call__(self, n: int) -> torch.Tensor:
        v = self._views.get(n)
        if v is None:
            v = self.tensor[:n]
            if len(self._views) < _MAX_CACHED_VIEWS:
                self._views[n] = v
        return v


class StagedRegion:
    """A fixed region of a `StepStaging`: `host` (numpy, written by the step) and `dev` (the device tensor at
    a fixed address), both of `numel` elements of `dtype`."""

    def __init__(self, staging: StepStaging, offset: int, numel: int, dtype: torch.dtype) -> None:
        self._staging = staging
        self.offset = offset
        self.numel = numel
        self.dtype = dtype
        # Made at first use (the buffer is allocated then, once, and never replaced): a put per step and
        # region must not build a numpy view each time.
        self._host: np.ndarray | None = None
        self._views: PrefixViews | None = None

    @property
    def host(self) -> np.ndarray:
        if self._host is None:
            self._host = self._staging.host_view(self.offset, self.numel, self.dtype)
        return self._host

    @property
    def dev(self) -> torch.Tensor:
        return self._staging.dev_view(self.offset, self.numel, self.dtype)

    def put(self, values: Sequence[int] | Sequence[float] | np.ndarray, start: int = 0) -> None:
        """host[start:start + len(values)] = values; sent by the next flush."""
        n = len(values)
        if start + n > self.numel:
            raise ValueError(f"{n} values at {start} overflow a staged region of {self.numel}")
        self._staging.mark(self.offset, (start + n) * self.dtype.itemsize)
        self.host[start : start + n] = values

    def touch(self, n: int) -> np.ndarray:
        """The host view of the first n elements, for writes by numpy (cumsum's `out=`); marks them sent."""
        self._staging.mark(self.offset, n * self.dtype.itemsize)
        return self.host[:n]

    def view(self, n: int) -> torch.Tensor:
        """The device tensor of the first n elements (the same object every time: `PrefixViews`)."""
        if self._views is None:
            self._views = PrefixViews(self.dev)
        return self._views(n)


class StepStaging:
    def __init__(self, device: torch.device, dynamic_bytes: int) -> None:
        self.device = device
        self._fixed_end = 0
        self._dynamic_bytes = _aligned(dynamic_bytes)
        self._host: torch.Tensor | None = None  # uint8, allocated at first use
        self._host_np: np.ndarray | None = None
        self._dev: torch.Tensor | None = None
        # torch's stubs leave Event's constructor and `query` unannotated
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._copy_pending = False
        self._open = False  # a step is writing: host written since the last flush
        self._end = 0  # bytes of the buffer's prefix this step writes
        self._next = 0  # the next staged tensor's offset

    # ------------------------------------------------------------------ layout
    def region(self, numel: int, dtype: torch.dtype) -> StagedRegion:
        """Declare a fixed region (before the first write or flush)."""
        if self._host is not None:
            raise RuntimeError("StepStaging.region: regions are declared before the buffer is first used")
        region = StagedRegion(self, self._fixed_end, numel, dtype)
        self._fixed_end = _aligned(self._fixed_end + numel * dtype.itemsize)
        return region

    def _allocate(self) -> None:
        size = self._fixed_end + self._dynamic_bytes
        # Not inference tensors, whichever mode the first step runs in: a copy into one outside
        # inference_mode would raise.
        with torch.inference_mode(False):
            self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._dev = torch.zeros(size, dtype=torch.uint8, device=self.device)
        self._host_np = self._host.numpy()

    def host_view(self, offset: int, numel: int, dtype: torch.dtype) -> np.ndarray:
        if self._host_np is None:
            self._allocate()
        assert self._host_np is not None
        return self._host_np[offset : offset + numel * dtype.itemsize].view(_NUMPY[dtype])

    def dev_view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._dev is None:
            self._allocate()
        assert self._dev is not None
        return self._dev[offset : offset + numel * dtype.itemsize].view(dtype)

    # ------------------------------------------------------------------ one step
    def begin(self, new_step: bool = False) -> None:
        """Start a step's writes: wait until the previous flush's copy has read the host buffer. Implied by
        every write; idempotent until the next flush. `new_step`: the first write of a step, which also
        drops whatever a step that failed before its flush left unsent."""
        if self._open and not new_step:
            return
        if self._host is None:
            self._allocate()
        if self._copy_pending and self._copied is not None and not self._copied.query():  # type: ignore[no-untyped-call]
            self._copied.synchronize()
        self._copy_pending = False
        self._open = True
        self._end = 0
        self._next = self._fixed_end

    def mark(self, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) are written this step: the flush sends them."""
        self.begin()
        self._end = max(self._end, offset + nbytes)

    def stage(self, values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """`values` as a device tensor of `dtype`, read only by work queued after the next flush. Packed behind
        the fixed regions; if this step's staging area is full, an immediate non-blocking upload instead."""
        self.begin()
        n = len(values)
        offset = self._next
        if offset + n * dtype.itemsize > self._fixed_end + self._dynamic_bytes:
            return to_device(torch.from_numpy(values) if isinstance(values, np.ndarray) else values, dtype, self.device)
        self._next = _aligned(offset + n * dtype.itemsize)
        self.mark(offset, n * dtype.itemsize)
        self.host_view(offset, n, dtype)[:] = values
        return self.dev_view(offset, n, dtype)

    def flush(self) -> None:
        """Send this step's writes: one non-blocking copy of the buffer's written prefix."""
        if not self._open:
            return
        self._open = False
        assert self._dev is not None and self._host is not None
        if self._end:
            self._dev[: self._end].copy_(self._host[: self._end], non_blocking=True)
        if self._copied is not None:  # also guards copies the step issued beside this one (`InputBuffers`)
            self._copied.record()
            self._copy_pending = True


_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
}
