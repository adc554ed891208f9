"""Inter-process communication between the engine and its tensor-parallel workers on one host.

Today: `ShmRingWriter`/`ShmRingReader`, a shared-memory broadcast ring carrying opaque bytes from the engine's
step thread to N worker processes. Plain standard library: importing this package never imports torch or numpy.
"""

from __future__ import annotations

from asyncllm.distributed.shm_reader import ShmRingReader
from asyncllm.distributed.shm_ring import (
    RingAttachError,
    RingClosedError,
    RingConfigError,
    RingHandle,
    RingNoSpaceError,
    RingTimeoutError,
)
from asyncllm.distributed.shm_writer import ShmRingWriter

__all__ = [
    "RingAttachError",
    "RingClosedError",
    "RingConfigError",
    "RingHandle",
    "RingNoSpaceError",
    "RingTimeoutError",
    "ShmRingReader",
    "ShmRingWriter",
]
