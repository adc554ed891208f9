"""One reader of the ring, in a worker process (or a thread): attaches from a `RingHandle`, reads every message.

Follows the protocol described in `shm_ring`: spins briefly for the next chunk, then sleeps on its wake-up
socket with a bounded re-check, and notices a writer that closed the ring or died. Never unlinks the segment
and never registers it with Python's resource tracker. Knows nothing of what the messages mean.
"""

from __future__ import annotations

import contextlib
import os
import time

from asyncllm.distributed.shm_ring import (
    DEFAULT_RECHECK_S,
    DEFAULT_SPIN_S,
    DETACHED,
    RingAttachError,
    RingClosedError,
    RingConfigError,
    RingHandle,
    RingTimeoutError,
    describe_process,
)
from asyncllm.distributed.shm_segment import U64, ReaderSegment, RingLayout, RingView
from asyncllm.distributed.shm_wakeup import AddressInUseError, Spinner, WakeSocket, reader_address, writer_address


class ShmRingReader:
    """Reads, in order, every message the writer broadcasts. Use from one thread; build with `attach`."""

    def __init__(
        self, handle: RingHandle, segment: ReaderSegment, wake: WakeSocket, spin_s: float, recheck_s: float
    ) -> None:
        self.rank = handle.rank
        self.name = handle.name
        self._segment: ReaderSegment | None = segment
        self._ring = RingView(segment.layout, segment.buf)
        self._wake = wake
        self._writer = writer_address(handle.name)
        self._spinner = Spinner(spin_s)
        self._recheck_s = recheck_s
        self._seq = 1  # the next chunk to read
        self._broken: str | None = None  # why a timeout mid-message left this reader unusable

    @classmethod
    def attach(
        cls, handle: RingHandle, *, spin_s: float = DEFAULT_SPIN_S, recheck_s: float = DEFAULT_RECHECK_S
    ) -> ShmRingReader:
        """Attach reader `handle.rank` (in any process on this host). Raises `RingClosedError` if the writer
        already closed the ring, `RingAttachError` if that rank was attached before or the handle is stale."""
        if not 0 <= handle.rank < handle.n_readers:
            raise RingAttachError(f"rank={handle.rank!r} is invalid: use 0..{handle.n_readers - 1}")
        if not spin_s >= 0:
            raise RingConfigError(f"spin_s={spin_s!r} is invalid: use seconds >= 0 (0: sleep at once)")
        if not recheck_s > 0:
            raise RingConfigError(f"recheck_s={recheck_s!r} is invalid: use a positive number of seconds (e.g. 0.05)")
        try:
            segment = ReaderSegment(handle.name, RingLayout(handle.n_readers, handle.n_slots, handle.slot_bytes))
        except FileNotFoundError:
            raise RingClosedError(
                f"ring {handle.name} does not exist: its writer closed it or exited before reader {handle.rank} "
                f"attached (or the handle comes from another host)"
            ) from None
        ring = RingView(segment.layout, segment.buf)
        wake: WakeSocket | None = None
        try:
            if ring.closed():
                raise RingClosedError(f"ring {handle.name} was closed before reader {handle.rank} attached")
            with contextlib.suppress(AddressInUseError):  # in use: that rank is attached right now
                wake = WakeSocket(reader_address(handle.name, handle.rank))
            earlier = ring.reader_pids()[handle.rank]
            if wake is None or earlier != 0:
                # A second reader of a rank would start at message 1 while the writer has moved on.
                raise RingAttachError(
                    f"reader {handle.rank} of ring {handle.name} was attached before ({describe_process(earlier)}): "
                    f"a rank attaches once; give every reader its own rank, or a restarted worker a new ring"
                )
        except BaseException:
            if wake is not None:
                wake.close()
            ring.release()
            segment.close()
            raise
        ring.set_reader_pid(handle.rank, os.getpid())
        return cls(handle, segment, wake, spin_s, recheck_s)

    def read(self, *, timeout: float | None = None) -> bytes:
        """The next message. Blocks until it is written; `timeout` (seconds) bounds the wait. Raises
        `RingClosedError` once the writer has closed the ring (or died) and every earlier message was read."""
        if self._segment is None:
            raise RingClosedError(f"reader {self.rank} of ring {self.name} is closed")
        if self._broken is not None:
            raise RingClosedError(self._broken)
        ring, seq = self._ring, self._seq
        deadline = None if timeout is None else time.monotonic() + timeout
        slot = seq % ring.layout.n_slots
        self._wait(seq, slot, deadline)
        ring.fence()
        total: int = U64.unpack_from(ring.buf, ring.written[slot] + 8)[0]
        cap = ring.layout.slot_bytes
        if total <= cap:
            at = ring.payload[slot]
            data = ring.buf[at : at + total].tobytes()
            self._release(slot, seq)
            return data
        out = bytearray(total)  # continued over the following slots: assemble, then one more copy to bytes
        for start in range(0, total, cap):
            if start:
                slot = seq % ring.layout.n_slots
                try:
                    self._wait(seq, slot, deadline)
                except RingTimeoutError as exc:
                    self._broken = f"reader {self.rank} of ring {self.name} timed out mid-message: {exc}"
                    raise
                except RingClosedError as exc:
                    self._broken = f"the writer of ring {self.name} stopped mid-message: {exc}"
                    raise RingClosedError(self._broken) from None
                ring.fence()
            take = min(cap, total - start)
            at = ring.payload[slot]
            out[start : start + take] = ring.buf[at : at + take]
            self._release(slot, seq)
            seq += 1
        return bytes(out)

    def _release(self, slot: int, seq: int) -> None:
        """Hand chunk `seq`'s slot back to the writer, and wake the writer if it sleeps waiting for one."""
        ring = self._ring
        ring.fence()  # our copy is done before the stamp says so
        ring.set_read_stamp(slot, self.rank, seq)
        self._seq = seq + 1
        ring.fence()  # the stamp is visible before we look at the writer's flag (see shm_ring: Sleeping)
        if ring.writer_waiting():
            self._wake.wake(self._writer)

    def _wait(self, seq: int, slot: int, deadline: float | None) -> None:
        """Return once chunk `seq` is written: poll for `spin_s`, then sleep until woken."""
        buf, at = self._ring.buf, self._ring.written[slot]
        if U64.unpack_from(buf, at)[0] == seq:
            return
        if self._spinner.spin(lambda: U64.unpack_from(buf, at)[0] == seq):
            return
        self._ring.set_sleeping(self.rank, True)
        try:
            self._sleep(seq, slot, deadline)
        finally:
            self._ring.set_sleeping(self.rank, False)

    def _sleep(self, seq: int, slot: int, deadline: float | None) -> None:
        ring = self._ring
        next_liveness_check = time.monotonic() + self._recheck_s
        while True:
            ring.fence()  # our sleeping flag is visible before we re-check the stamp
            if ring.written_stamp(slot) == seq:
                return
            now = time.monotonic()
            if ring.closed() or now >= next_liveness_check:
                ring.fence()
                if ring.written_stamp(slot) == seq:
                    return  # written before the close (or before the writer died): deliver it first
                self._raise_if_writer_gone()
                next_liveness_check = now + self._recheck_s
            if deadline is not None and now >= deadline:
                raise RingTimeoutError(
                    f"reader {self.rank} of ring {self.name} waited past its timeout for the next message "
                    f"(chunk {seq}; writer pid {ring.writer_pid()}): pass a larger timeout if the writer is idle"
                )
            self._wake.wait(self._recheck_s if deadline is None else min(self._recheck_s, deadline - now))

    def _raise_if_writer_gone(self) -> None:
        ring = self._ring
        # The writer's wake-up socket is bound until its close() (which sets the closed flag first) or its death.
        if not ring.closed() and not self._wake.wake(self._writer):
            ring.fence()
            if not ring.closed():
                raise RingClosedError(
                    f"the writer of ring {self.name} (pid {ring.writer_pid()}) exited without closing the ring"
                )
        if ring.closed():
            raise RingClosedError(f"ring {self.name} was closed by its writer; every message before was read")

    def close(self) -> None:
        """Detach (the segment stays for the writer and the other readers). Idempotent."""
        if self._segment is None:
            return
        self._ring.set_sleeping(self.rank, False)
        self._ring.set_reader_pid(self.rank, DETACHED)
        self._wake.close()
        self._ring.release()
        self._segment.close()
        self._segment = None

    def __enter__(self) -> ShmRingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
