"""Giving freed host memory back to the system on a CPU engine (glibc), so resident memory follows what the
model holds rather than the most its load or a prompt ever held.

glibc serves large blocks from its heap once frees have raised its dynamic mmap threshold (up to 32 MiB), and
keeps freed heap pages: a CPU load's float32 temporaries and a prompt chunk's activations then stay resident.
`return_large_blocks` fixes the threshold (lower while loading), so blocks from it up are mapped on their own
and unmapped when freed; `trim` hands the heap's free pages back (after the load). Anywhere but glibc (musl,
macOS) both do nothing.
Knows nothing of torch or models.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache
from typing import Any

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
# While serving, blocks from this size up are mapped alone. A decode step's tensors stay below it (SmolLM2's
# largest, a layer's gathered keys, is 768 bytes a token: 4 MiB is ~5,400 tokens), so they never pay a page
# fault per page; prompt chunks' activations are above.
LARGE_BLOCK = 4 << 20
# While loading, lower: a checkpoint's per-tensor copies (a few hundred KiB to a few MiB each) come and go
# between the weights that stay, and left in the heap they would keep it at its high-water mark.
LOAD_BLOCK = 256 << 10


@cache
def _glibc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def return_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """Blocks of `threshold` bytes or more mapped alone from now on (for the whole process). Whether it took."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


def trim() -> None:
    """The heap's free pages back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
