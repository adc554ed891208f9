"""Inter-process communication between the engine and its tensor-parallel workers on one host.

`ShmRingWriter`/`ShmRingReader`, a shared-memory broadcast ring carrying opaque bytes from the engine's
step thread to N worker processes, and `parallel_state` (the tensor-parallel process group; it imports torch,
so it is not imported here). Importing this package never imports torch or numpy.
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
