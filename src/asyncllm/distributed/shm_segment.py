"""The ring's shared-memory segment: its byte layout, its creation by the writer and its attachment by readers.

Owns where every header field, flag, stamp and payload lives, typed access to them, and who may unlink the
segment (only the creator). Knows nothing of the protocol (what stamps mean, who waits for whom) nor of
wake-ups. Linux only: readers map /dev/shm/<name> directly, so they never touch Python's resource tracker.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from multiprocessing import shared_memory

from asyncllm.distributed.shm_ring import RingAttachError, RingNoSpaceError

SHM_DIR = "/dev/shm"
MAGIC = b"ALLMRNG1"
LAYOUT_VERSION = 1
_LINE = 64  # cache line: fields written by different processes never share one

# magic, layout version, n_readers, n_slots, (pad), slot_bytes, writer pid
HEADER = struct.Struct("<8sIIIIQQ")
CLOSED_OFFSET = 40  # u8, after HEADER; set last, by the writer only
WRITER_WAITING_OFFSET = 41  # u8: the writer sleeps until a reader frees a slot
U64 = struct.Struct("<Q")


def _align(n: int) -> int:
    return (n + _LINE - 1) // _LINE * _LINE


@dataclass(frozen=True)
class RingLayout:
    """Byte offsets of one ring. Segment:

    | header: HEADER, closed, writer waiting (64) | sleeping flags: n_readers x u8 | reader pids: n_readers x u64 |
    | slot 0 | slot 1 | ...

    and each slot (every part 64-aligned):

    | written stamp u64, message length u64 | read stamps: n_readers x u64 | payload: slot_bytes |
    """

    n_readers: int
    n_slots: int
    slot_bytes: int

    @property
    def sleeping_offset(self) -> int:
        return _LINE

    @property
    def pids_offset(self) -> int:
        return self.sleeping_offset + _align(self.n_readers)

    @property
    def slots_offset(self) -> int:
        return self.pids_offset + _align(8 * self.n_readers)

    @property
    def slot_stride(self) -> int:
        return _LINE + _align(8 * self.n_readers) + _align(self.slot_bytes)

    @property
    def total_bytes(self) -> int:
        return self.slots_offset + self.n_slots * self.slot_stride

    def written_offset(self, slot: int) -> int:
        """The written stamp (u64); the message length (u64) follows it."""
        return self.slots_offset + slot * self.slot_stride

    def read_stamps_offset(self, slot: int) -> int:
        return self.written_offset(slot) + _LINE

    def payload_offset(self, slot: int) -> int:
        return self.read_stamps_offset(slot) + _align(8 * self.n_readers)


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class WriterSegment:
    """Creates the segment, writes its header; `unlink` removes its /dev/shm entry. Registered with Python's
    resource tracker, so a writer process that dies without closing still has its segment removed."""

    def __init__(self, name: str, layout: RingLayout) -> None:
        self.name = name
        self.layout = layout
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=layout.total_bytes)
        try:
            _reserve(name, layout.total_bytes)
        except BaseException:
            self._shm.close()
            self._shm.unlink()
            raise
        buf = self._shm.buf
        assert buf is not None
        self.buf: memoryview = buf  # fresh tmpfs pages read as zeros: every stamp and flag starts at 0
        HEADER.pack_into(
            buf, 0, MAGIC, LAYOUT_VERSION, layout.n_readers, layout.n_slots, 0, layout.slot_bytes, os.getpid()
        )

    def close_and_unlink(self) -> None:
        self._shm.close()  # releases self.buf: no slice of it may outlive this call
        self._shm.unlink()


def _reserve(name: str, size: int) -> None:
    """Allocate every page now: a full /dev/shm (Docker's default is 64 MB) then fails here with an error
    naming the fix, instead of killing the process with SIGBUS at the first write into a missing page."""
    fd = os.open(segment_path(name), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise RingNoSpaceError(
            errno.ENOSPC,
            f"{SHM_DIR} has no room for a {size / 2**20:.1f} MiB ring: free space there, give the container a "
            f"larger one (docker run --shm-size=1g) or use smaller slot_bytes/n_slots",
        ) from exc
    finally:
        os.close(fd)


class ReaderSegment:
    """Maps an existing segment by name, without SharedMemory: Python's resource tracker of a non-creator
    process would otherwise unlink it when that process exits, under the writer and every other reader."""

    def __init__(self, name: str, layout: RingLayout) -> None:
        self.name = name
        self.layout = layout
        fd = os.open(segment_path(name), os.O_RDWR)  # FileNotFoundError: the writer closed or never created it
        try:
            size = os.fstat(fd).st_size
            if size < layout.total_bytes:
                raise RingAttachError(f"ring segment {name!r} has {size} bytes, its handle needs {layout.total_bytes}")
            self._mmap = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory; the fd is not needed
        self.buf = memoryview(self._mmap)
        magic, version, n_readers, n_slots, _, slot_bytes, _ = HEADER.unpack_from(self.buf, 0)
        found = (magic, version, n_readers, n_slots, slot_bytes)
        wanted = (MAGIC, LAYOUT_VERSION, layout.n_readers, layout.n_slots, layout.slot_bytes)
        if found != wanted:
            self.close()
            raise RingAttachError(f"ring segment {name!r} holds {found}, its handle says {wanted}: a stale handle?")

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


class RingView:
    """Precomputed offsets and typed access to the fields both ends share, plus the fence (see shm_ring)."""

    def __init__(self, layout: RingLayout, buf: memoryview) -> None:
        self.layout = layout
        self.buf = buf
        n = layout.n_slots
        self.written = [layout.written_offset(i) for i in range(n)]
        self.read_stamps = [layout.read_stamps_offset(i) for i in range(n)]
        self.payload = [layout.payload_offset(i) for i in range(n)]
        self.stamps = struct.Struct(f"<{layout.n_readers}Q")  # also the reader pids
        self.flags = struct.Struct(f"<{layout.n_readers}B")
        self._fence_lock = threading.Lock()

    def fence(self) -> None:
        self._fence_lock.acquire()
        self._fence_lock.release()

    def closed(self) -> bool:
        return self.buf[CLOSED_OFFSET] != 0

    def set_closed(self) -> None:
        self.buf[CLOSED_OFFSET] = 1

    def writer_waiting(self) -> bool:
        return self.buf[WRITER_WAITING_OFFSET] != 0

    def set_writer_waiting(self, waiting: bool) -> None:
        self.buf[WRITER_WAITING_OFFSET] = int(waiting)

    def writer_pid(self) -> int:
        return int(HEADER.unpack_from(self.buf, 0)[6])

    def reader_pids(self) -> tuple[int, ...]:
        return self.stamps.unpack_from(self.buf, self.layout.pids_offset)

    def set_reader_pid(self, rank: int, pid: int) -> None:
        U64.pack_into(self.buf, self.layout.pids_offset + 8 * rank, pid)

    def set_sleeping(self, rank: int, asleep: bool) -> None:
        self.buf[self.layout.sleeping_offset + rank] = int(asleep)  # one byte: no torn store

    def sleeping(self) -> tuple[int, ...]:
        return self.flags.unpack_from(self.buf, self.layout.sleeping_offset)

    def min_read_stamp(self, slot: int) -> int:
        return int(min(self.stamps.unpack_from(self.buf, self.read_stamps[slot])))

    def set_read_stamp(self, slot: int, rank: int, seq: int) -> None:
        U64.pack_into(self.buf, self.read_stamps[slot] + 8 * rank, seq)

    def written_stamp(self, slot: int) -> int:
        return int(U64.unpack_from(self.buf, self.written[slot])[0])

    def release(self) -> None:
        """Drop this view's hold on the mapping, so the segment can close it."""
        self.buf = memoryview(b"")
