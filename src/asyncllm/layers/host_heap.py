"""Giving freed host memory back to the system on a CPU engine (glibc), so resident memory follows what the
model holds rather than the most its load ever held.

A CPU load copies whole weights (a few hundred KiB to a few MiB each) between the weights that stay; glibc
serves such blocks from its heap once frees have raised its dynamic mmap threshold, and keeps freed heap pages,
so the load's high-water mark would stay resident. `for_load` maps blocks from 256 KiB up on their own (unmapped
when freed); `for_serving` then hands the heap's free pages back and sets glibc's own ceiling pair (blocks from
32 MiB mapped, 64 MiB of free heap kept before trimming): a prompt chunk's activations are reused from the heap,
not faulted in afresh each step (with the load's setting, a 512-token prompt ran a third slower). `release`
hands back the pages of a tensor being replaced slice by slice. Anywhere but glibc (musl, macOS) all do nothing.
Knows nothing of models.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from functools import cache
from typing import Any

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_MADV_DONTNEED = 4  # madvise's advice number (Linux)
LOAD_BLOCK = 256 << 10
SERVING_BLOCK = 32 << 20  # glibc's largest dynamic mmap threshold on 64-bit; the trim threshold follows at 2x


@cache
def _glibc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if all(hasattr(libc, f) for f in ("mallopt", "malloc_trim", "madvise")) else None


def for_load() -> None:
    """Blocks from LOAD_BLOCK up mapped alone from now on (for the whole process)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, LOAD_BLOCK)


def for_serving() -> None:
    """The heap's free pages back to the system, and glibc's steady-state thresholds (see the module)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, SERVING_BLOCK)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * SERVING_BLOCK)
        libc.malloc_trim(0)


def release(t: torch.Tensor) -> None:
    """The whole pages inside a contiguous CPU tensor's memory handed back to the system: they read as zeros
    from then on, so only for a tensor nobody reads again (a table being replaced, a slice at a time)."""
    libc = _glibc()
    if libc is None or not t.is_contiguous() or t.device.type != "cpu":
        return
    page = mmap.PAGESIZE
    start = t.data_ptr()
    first, last = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
    if last > first:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
