"""The ring's one writer: creates the segment, copies messages into slots, wakes sleeping readers, and closes.

Follows the protocol described in `shm_ring`; while the slowest reader lags a full ring behind it spins
briefly, then sleeps until a reader frees a slot, warns once per stall past `warn_after_s` naming the late
readers, and raises on `timeout`. Knows nothing of what the messages mean.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence

from asyncllm.distributed.shm_ring import (
    DEFAULT_N_SLOTS,
    DEFAULT_RECHECK_S,
    DEFAULT_SLOT_BYTES,
    BytesLike,
    RingClosedError,
    RingConfigError,
    RingHandle,
    RingTimeoutError,
    describe_process,
)
from asyncllm.distributed.shm_segment import U64, RingLayout, RingView, WriterSegment
from asyncllm.distributed.shm_wakeup import Spinner, WakeSocket, reader_address, writer_address

RING_PREFIX = "asyncllm-ring-"  # then the creating process's id and a random part: /dev/shm/<name>

logger = logging.getLogger(__name__)

_SPIN_S = 50e-6


class ShmRingWriter:
    """The one writer. Not thread-safe: use it from one thread (the engine's step thread).

    `close()` (or leaving a `with` block) marks the ring closed, wakes every reader and removes the segment's
    /dev/shm entry; readers still drain what was written before, then get `RingClosedError`.
    """

    def __init__(
        self,
        n_readers: int,
        *,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        n_slots: int = DEFAULT_N_SLOTS,
        warn_after_s: float = 10.0,
        recheck_s: float = DEFAULT_RECHECK_S,
    ) -> None:
        for field, value in (("n_readers", n_readers), ("slot_bytes", slot_bytes), ("n_slots", n_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RingConfigError(f"{field}={value!r} is invalid: use an integer >= 1")
        for field, seconds in (("warn_after_s", warn_after_s), ("recheck_s", recheck_s)):
            if not seconds > 0:
                raise RingConfigError(f"{field}={seconds!r} is invalid: use a positive number of seconds")
        if not sys.platform.startswith("linux"):
            raise RingConfigError(
                f"the shared-memory ring needs Linux (/dev/shm, abstract sockets), not {sys.platform}: "
                f"run tensor-parallel workers on Linux"
            )
        layout = RingLayout(n_readers, n_slots, slot_bytes)
        # Unique (engines on one host never collide), and naming its creator: a segment a killed engine left
        # in /dev/shm says whose it was, and one process's checks need not see another's rings.
        self.name = f"{RING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self._segment: WriterSegment | None = WriterSegment(self.name, layout)
        self._ring = RingView(layout, self._segment.buf)
        try:
            self._wake = WakeSocket(writer_address(self.name))
        except BaseException:
            self._segment.close_and_unlink()
            raise
        self._readers = [reader_address(self.name, rank) for rank in range(n_readers)]
        self._warn_after_s = warn_after_s
        self._recheck_s = recheck_s  # a blocked writer re-checks this often, should a reader's poke be lost
        self._spinner = Spinner(_SPIN_S)
        self._seq = 1  # the next chunk's number
        self._messages = 0  # written in full
        self._abandoned = False

    def reader_handle(self, rank: int) -> RingHandle:
        layout = self._ring.layout
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.n_readers:
            raise RingConfigError(f"rank={rank!r} is invalid: this ring has readers 0..{layout.n_readers - 1}")
        return RingHandle(self.name, layout.n_readers, layout.n_slots, layout.slot_bytes, rank)

    def wait_for_readers(self, timeout: float | None = None) -> None:
        """Block until every reader has attached. Optional: messages written earlier simply wait in the ring."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while missing := [rank for rank, pid in enumerate(self._ring.reader_pids()) if pid == 0]:
            if deadline is not None and time.monotonic() >= deadline:
                raise RingTimeoutError(
                    f"ring {self.name}: readers {missing} did not attach within {timeout} s: check that their "
                    f"processes started and called ShmRingReader.attach(handle), or pass a larger timeout"
                )
            time.sleep(1e-3)

    def write(self, data: BytesLike, *, timeout: float | None = None) -> None:
        """Broadcast one message. Blocks while the ring is full; `timeout` (seconds) bounds that wait."""
        self.write_parts((data,), timeout=timeout)

    def write_parts(self, parts: Sequence[BytesLike], *, timeout: float | None = None) -> None:
        """Broadcast the concatenation of `parts` as one message, copying each part straight into the ring.

        A timeout before the first chunk leaves the ring as it was; one mid-message closes the ring (no reader
        may be handed half a message) and `close()` must follow.
        """
        self._check_open()
        ring, buf = self._ring, self._ring.buf
        n_slots, cap = ring.layout.n_slots, ring.layout.slot_bytes
        views = [memoryview(p).cast("B") for p in parts]  # any C-contiguous buffer, counted in bytes
        try:
            total = sum(view.nbytes for view in views)
            deadline = None if timeout is None else time.monotonic() + timeout
            part, pos = 0, 0  # the next byte to copy is views[part][pos]
            for chunk in range(max(1, -(-total // cap))):
                seq = self._seq
                slot = seq % n_slots
                try:
                    self._wait_free(seq, slot, deadline)
                except RingTimeoutError:
                    if chunk:
                        self._abandoned = True
                        self._mark_closed()
                    raise
                ring.fence()
                at = ring.payload[slot]
                end = at + min(cap, total - chunk * cap)
                while at < end:
                    view = views[part]
                    take = min(end - at, view.nbytes - pos)
                    buf[at : at + take] = view[pos : pos + take]
                    at, pos = at + take, pos + take
                    if pos == view.nbytes:
                        part, pos = part + 1, 0
                U64.pack_into(buf, ring.written[slot] + 8, total)
                ring.fence()
                U64.pack_into(buf, ring.written[slot], seq)  # publishes the chunk
                self._seq = seq + 1
                ring.fence()
                sleeping = ring.sleeping()
                if any(sleeping):
                    for rank, asleep in enumerate(sleeping):
                        if asleep:
                            self._wake.wake(self._readers[rank])
            self._messages += 1
        finally:
            for view in views:
                view.release()  # so the caller may resize its bytearray again

    def wait_until_read(self, timeout: float | None = None) -> None:
        """Block until every reader has read every message written so far (e.g. before a clean shutdown)."""
        self._check_open()
        last = self._seq - 1
        if last:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._wait_read(last, last % self._ring.layout.n_slots, deadline, "for every message to be read")

    def _wait_free(self, seq: int, slot: int, deadline: float | None) -> None:
        need = seq - self._ring.layout.n_slots  # the chunk this slot held one lap ago
        if need > 0:
            self._wait_read(need, slot, deadline, f"for a free slot to write message {self._messages + 1}")

    def _wait_read(self, need: int, slot: int, deadline: float | None, purpose: str) -> None:
        """Wait until every reader has read chunk `need` (which lives in `slot`): spin, then sleep until a
        reader pokes us (see shm_ring: the same handshake as a sleeping reader's, roles swapped)."""
        ring = self._ring
        if ring.min_read_stamp(slot) >= need:
            return
        if self._spinner.spin(lambda: ring.min_read_stamp(slot) >= need):
            return
        start = time.monotonic()
        warn_at: float | None = start + self._warn_after_s
        ring.set_writer_waiting(True)
        try:
            while True:
                ring.fence()  # our waiting flag is visible before we re-check the stamps
                if ring.min_read_stamp(slot) >= need:
                    return
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise RingTimeoutError(f"{self._late(need, slot, now - start, purpose)}; pass a larger timeout")
                if warn_at is not None and now >= warn_at:
                    logger.warning("%s; still waiting", self._late(need, slot, now - start, purpose))
                    warn_at = None
                wake_by = min(t for t in (now + self._recheck_s, deadline, warn_at) if t is not None)
                self._wake.wait(wake_by - now)
        finally:
            ring.set_writer_waiting(False)

    def _late(self, need: int, slot: int, waited: float, purpose: str) -> str:
        ring = self._ring
        stamps = ring.stamps.unpack_from(ring.buf, ring.read_stamps[slot])
        pids = ring.reader_pids()
        late = ", ".join(f"reader {r} ({describe_process(pids[r])})" for r, s in enumerate(stamps) if s < need)
        return f"ring {self.name}: the writer waited {waited:.2f} s {purpose}; not yet read chunk {need}: {late}"

    def _check_open(self) -> None:
        if self._segment is None:
            raise RingClosedError(f"ring {self.name} is closed: this writer cannot write any more")
        if self._abandoned:
            raise RingClosedError(f"ring {self.name} was closed by a timeout mid-message: close() the writer")

    def _mark_closed(self) -> None:
        self._ring.fence()  # every published stamp is visible before the closed flag
        self._ring.set_closed()
        self._ring.fence()
        for address in self._readers:
            self._wake.wake(address)

    def close(self) -> None:
        """Mark the ring closed, wake every reader, unlink the segment. Idempotent."""
        if self._segment is None:
            return
        self._mark_closed()
        self._wake.close()
        self._ring.release()
        self._segment.close_and_unlink()
        self._segment = None

    def __enter__(self) -> ShmRingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
