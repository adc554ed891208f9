"""The host side of constrained rows' bitmasks: `HostRows`, one set of rows (each row's int32 bitmask words
and its UTF-8 state) that a step's matchers fill and the device's copy reads; two sets that steps alternate
between. Where the grammar process may fill them they live in a shared segment (`RowsSegment`: a memfd, so
no name in /dev/shm and nothing to clean up after a crash; the child maps the same pages), registered with
CUDA as pinned memory where the driver takes it. Knows nothing of grammars, matchers or steps.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

_PAGE = 4096


@dataclass(frozen=True)
class RowsLayout:
    """`sets` sets of `rows` rows, `words` int32 words each: set k's bits, then its states (int64), page-aligned;
    then a page whose first 2 x `sets` uint32 words are the sets' flags (`flags`: the grammar process's for
    each set, then the step thread's; each counts the fills of its set that are complete, for the device to
    wait on)."""

    sets: int
    rows: int
    words: int

    @property
    def set_bytes(self) -> int:
        used = self.rows * self.words * 4 + self.rows * 8
        return -(-used // _PAGE) * _PAGE

    @property
    def nbytes(self) -> int:
        return self.sets * self.set_bytes + _PAGE

    def flags(self, buffer: memoryview | mmap.mmap) -> np.ndarray:
        """The sets' flags [2 * sets] uint32 (the process's, then the step thread's), viewing `buffer`."""
        return np.frombuffer(buffer, np.uint32, 2 * self.sets, self.sets * self.set_bytes)

    def views(self, buffer: memoryview | mmap.mmap) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each set's (bits [rows, words] int32, states [rows] int64), viewing `buffer`."""
        out = []
        for k in range(self.sets):
            at = k * self.set_bytes
            bits = np.frombuffer(buffer, np.int32, self.rows * self.words, at).reshape(self.rows, self.words)
            states = np.frombuffer(buffer, np.int64, self.rows, at + self.rows * self.words * 4)
            out.append((bits, states))
        return out


class RowsSegment:
    """Shared memory for a `RowsLayout`: made by the engine's process, mapped by the grammar process from the
    descriptor it inherits (`attach`)."""

    def __init__(self, layout: RowsLayout, fd: int | None = None) -> None:
        self.layout = layout
        if fd is None:
            fd = os.memfd_create("asyncllm-grammar-rows", os.MFD_CLOEXEC)
            os.ftruncate(fd, layout.nbytes)
        self.fd = fd
        self.buffer = mmap.mmap(fd, layout.nbytes)
        self.flags = layout.flags(self.buffer)
        self._registered: int | None = None  # the address CUDA pinned

    @classmethod
    def attach(cls, fd: int, layout: RowsLayout) -> RowsSegment:
        return cls(layout, fd)

    def pin(self) -> bool:
        """Register the pages with CUDA so copies from them are asynchronous DMA; False if the driver refuses
        (copies then go through the driver's own staging, holding the step thread for the copy)."""
        address = np.frombuffer(self.buffer, np.uint8, 1).ctypes.data
        error = int(torch.cuda.cudart().cudaHostRegister(address, self.layout.nbytes, 0))  # type: ignore[no-untyped-call]
        if error != 0:
            logger.warning("the grammar rows' shared memory could not be pinned (cudaError %d): copies wait", error)
            return False
        self._registered = address
        return True

    @property
    def pinned(self) -> bool:
        return self._registered is not None

    def flag_address(self, index: int) -> int:
        """The host address of set `index`'s flag."""
        return int(self.flags.ctypes.data) + 4 * index

    def close(self) -> None:
        """Unpin and close the descriptor; the mapping goes with the last view of it."""
        if self._registered is not None:
            torch.cuda.synchronize()  # no copy from these pages may still be in flight
            torch.cuda.cudart().cudaHostUnregister(self._registered)  # type: ignore[no-untyped-call]
            self._registered = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostRows:
    """One set of rows on the host: `bits` [rows, words] int32 and `states` [rows] int64, as tensors for the
    upload and as numpy arrays for whoever fills them. `writable()` waits until the last upload from them
    has read them (a query first: no wait, and no GIL release, when it has)."""

    def __init__(self, index: int, bits: torch.Tensor, states: torch.Tensor, event: bool) -> None:
        self.index = index  # which set of the layout: how the grammar process names it
        self.bits, self.states = bits, states
        self.bits_np, self.states_np = bits.numpy(), states.numpy()
        self.copied = torch.cuda.Event() if event else None  # type: ignore[no-untyped-call]

    def writable(self) -> None:
        if self.copied is not None and not self.copied.query():  # type: ignore[no-untyped-call]
            self.copied.synchronize()


def host_row_sets(layout: RowsLayout, device: torch.device, shared: bool) -> tuple[list[HostRows], RowsSegment | None]:
    """The layout's sets: in a shared segment (`shared`: the grammar process may fill them) or in torch's
    pinned memory (CUDA) or plain memory (CPU)."""
    cuda = device.type == "cuda"
    if shared:
        segment = RowsSegment(layout)
        if cuda:
            segment.pin()
        views = layout.views(segment.buffer)
        tensors = [(torch.from_numpy(bits), torch.from_numpy(states)) for bits, states in views]
        return [HostRows(k, bits, states, cuda) for k, (bits, states) in enumerate(tensors)], segment
    sets = []
    with torch.inference_mode(False):
        for k in range(layout.sets):
            bits = torch.zeros((layout.rows, layout.words), dtype=torch.int32, pin_memory=cuda)
            states = torch.zeros(layout.rows, dtype=torch.int64, pin_memory=cuda)
            sets.append(HostRows(k, bits, states, cuda))
    return sets, None
