"""The shared-memory broadcast ring with readers attached in this process (threads, or read in turn): a
property test over message sizes and ring shapes, and the API's edges (timeouts, warnings, closing, attach
errors, buffers). Behaviour that is about processes lives in test_shm_ring.py.
"""

from __future__ import annotations

import array
import dataclasses
import errno
import itertools
import logging
import os
import pickle
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.distributed import (
    RingAttachError,
    RingClosedError,
    RingConfigError,
    RingNoSpaceError,
    RingTimeoutError,
    ShmRingReader,
    ShmRingWriter,
)
from asyncllm.distributed.shm_wakeup import Spinner
from asyncllm.errors import AsyncLLMError
from tests.fixtures.shm import no_leaked_segments, ring_segments  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_leaked_segments")  # every test leaves /dev/shm as it found it


class ReaderThread(threading.Thread):
    """Reads until the ring closes; keeps the messages, how it closed, or the unexpected error."""

    def __init__(self, reader: ShmRingReader) -> None:
        super().__init__(daemon=True)
        self.reader = reader
        self.messages: list[bytes] = []
        self.closed: RingClosedError | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while True:
                self.messages.append(self.reader.read(timeout=30))
        except RingClosedError as exc:
            self.closed = exc
        except BaseException as exc:
            self.error = exc
        finally:
            self.reader.close()


def _parts(message: bytes, n: int) -> list[bytes | bytearray | memoryview]:
    cuts = [len(message) * i // n for i in range(n + 1)]
    kinds = [bytes, bytearray, memoryview]
    return [kinds[i % 3](message[a:b]) for i, (a, b) in enumerate(itertools.pairwise(cuts))]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 600), max_size=30),
    slot_bytes=st.sampled_from([7, 64, 256]),
    n_slots=st.integers(1, 4),
    n_readers=st.integers(1, 3),
    n_parts=st.integers(1, 4),
    spin_s=st.sampled_from([0.0, 50e-6]),
)
@pytest.mark.slow
def test_any_message_sizes_arrive_intact_in_order(
    sizes: list[int], slot_bytes: int, n_slots: int, n_readers: int, n_parts: int, spin_s: float
) -> None:
    """Property: for any sequence of sizes (0 to ~90 slots long), ring shape (1-4 slots) and 1-3 readers, each
    reader gets exactly the messages written, in order, whether written whole or in parts, spinning or not."""
    rng = random.Random(len(sizes))
    messages = [rng.randbytes(size) for size in sizes]
    with ShmRingWriter(n_readers, slot_bytes=slot_bytes, n_slots=n_slots) as writer:
        threads = [ReaderThread(ShmRingReader.attach(writer.reader_handle(r), spin_s=spin_s)) for r in range(n_readers)]
        for thread in threads:
            thread.start()
        for i, message in enumerate(messages):
            if i % 2:
                writer.write_parts(_parts(message, n_parts), timeout=30)
            else:
                writer.write(message, timeout=30)
    for thread in threads:
        thread.join(timeout=30)
        assert thread.error is None
        assert thread.messages == messages


def test_handle_is_small_and_picklable() -> None:
    """The handle a worker gets pickles (for spawn) into a few hundred bytes and round-trips equal."""
    with ShmRingWriter(4) as writer:
        handle = writer.reader_handle(3)
        blob = pickle.dumps(handle)
        assert len(blob) < 400 and pickle.loads(blob) == handle


def test_close_removes_segment_even_with_readers_attached() -> None:
    """After the writer's close() no /dev/shm entry of the ring remains, though readers still map it; they then
    drain what was written before the close and get RingClosedError (an AsyncLLMError and an EOFError)."""
    writer = ShmRingWriter(2, slot_bytes=16, n_slots=8)
    readers = [ShmRingReader.attach(writer.reader_handle(r)) for r in range(2)]
    assert writer.name in ring_segments()
    for message in (b"a", b"b" * 40, b""):  # 5 chunks: they all fit before anyone reads
        writer.write(message, timeout=5)
    writer.close()
    writer.close()  # idempotent
    assert writer.name not in ring_segments()
    for reader in readers:
        assert [reader.read(), reader.read(), reader.read()] == [b"a", b"b" * 40, b""]
        with pytest.raises(RingClosedError, match="closed by its writer") as caught:
            reader.read(timeout=5)
        assert isinstance(caught.value, AsyncLLMError) and isinstance(caught.value, EOFError)
        reader.close()


def test_two_rings_side_by_side() -> None:
    """Two writers on one host get distinct segment names and never see each other's messages."""
    with ShmRingWriter(1) as a, ShmRingWriter(1) as b:
        assert a.name != b.name
        with ShmRingReader.attach(a.reader_handle(0)) as ra, ShmRingReader.attach(b.reader_handle(0)) as rb:
            a.write(b"for a")
            b.write(b"for b")
            assert (ra.read(timeout=5), rb.read(timeout=5)) == (b"for a", b"for b")


def test_read_timeout_is_clear_and_reader_stays_usable() -> None:
    """read(timeout) on an idle ring raises RingTimeoutError (also a TimeoutError) after about that long, naming
    the reader and the ring; the reader then reads the next message normally."""
    with ShmRingWriter(1) as writer, ShmRingReader.attach(writer.reader_handle(0)) as reader:
        start = time.monotonic()
        with pytest.raises(RingTimeoutError, match=rf"reader 0 of ring {writer.name} waited") as caught:
            reader.read(timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 1.0
        assert isinstance(caught.value, TimeoutError)
        writer.write(b"later")
        assert reader.read(timeout=5) == b"later"


def test_write_timeout_names_late_readers_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """A writer blocked on a full ring warns once per stall (past warn_after_s) and then times out, both naming
    the reader that has not read (with its pid) and not the one that has."""
    with ShmRingWriter(2, slot_bytes=8, n_slots=2, warn_after_s=0.05) as writer:
        fast = ShmRingReader.attach(writer.reader_handle(0))
        slow = ShmRingReader.attach(writer.reader_handle(1))
        writer.write(b"1")
        writer.write(b"2")
        assert (fast.read(), fast.read()) == (b"1", b"2")
        with caplog.at_level(logging.WARNING), pytest.raises(RingTimeoutError) as caught:
            writer.write(b"3", timeout=0.3)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        for text in (warnings[0], str(caught.value)):
            assert f"reader 1 (pid {os.getpid()}, alive)" in text and "reader 0" not in text
        assert slow.read() == b"1"
        writer.write(b"3", timeout=5)  # the slot is free again: a timeout before the first chunk changed nothing
        assert (slow.read(), slow.read(), fast.read()) == (b"2", b"3", b"3")
        fast.close(), slow.close()


def test_blocked_writer_is_woken_by_the_reader_that_frees_a_slot() -> None:
    """A writer asleep on a full ring (its re-check set to 10 s) resumes as soon as the lagging reader reads:
    the reader's poke wakes it, not the re-check."""
    with ShmRingWriter(1, slot_bytes=8, n_slots=1, recheck_s=10.0) as writer:
        reader = ShmRingReader.attach(writer.reader_handle(0))
        writer.write(b"first")
        read_at: list[float] = []

        def read_later() -> None:
            time.sleep(0.3)
            read_at.append(time.monotonic())
            reader.read()

        thread = threading.Thread(target=read_later)
        thread.start()
        writer.write(b"second", timeout=20)  # blocks until `first` is read
        resumed = time.monotonic() - read_at[0]
        thread.join()
        assert resumed < 2.0, f"the writer resumed {resumed:.2f} s after the read: it was not woken"
        assert reader.read(timeout=5) == b"second"
        reader.close()


def test_timeout_mid_message_closes_the_ring() -> None:
    """A write that times out after sending part of a multi-slot message closes the ring: a reader inside that
    message gets RingClosedError instead of half a message, and later writes are refused until close()."""
    with ShmRingWriter(2, slot_bytes=8, n_slots=2) as writer:
        eager = ReaderThread(ShmRingReader.attach(writer.reader_handle(0)))
        idle = ShmRingReader.attach(writer.reader_handle(1))  # never reads
        eager.start()
        with pytest.raises(RingTimeoutError):
            writer.write(bytes(40), timeout=0.3)  # 5 chunks, only 2 slots
        eager.join(timeout=5)
        assert eager.error is None and "stopped mid-message" in str(eager.closed)
        assert eager.messages == []
        with pytest.raises(RingClosedError, match="timeout mid-message"):
            writer.write(b"x")
        idle.close()


@pytest.mark.parametrize("problem", ["rank twice", "rank after close", "rank out of range", "stale layout"])
def test_attach_refuses_bad_handles(problem: str) -> None:
    """attach() refuses, with RingAttachError naming the fix: a rank attached twice (even after the first one
    closed: it would restart at message 1), a rank outside the ring, a handle whose layout differs."""
    with ShmRingWriter(2, slot_bytes=64, n_slots=2) as writer:
        first = ShmRingReader.attach(writer.reader_handle(0))
        handle = writer.reader_handle(0)
        if problem == "rank after close":
            first.close()
        elif problem == "rank out of range":
            handle = dataclasses.replace(handle, rank=2)
        elif problem == "stale layout":
            handle = dataclasses.replace(writer.reader_handle(1), slot_bytes=128)
        with pytest.raises(RingAttachError):
            ShmRingReader.attach(handle)
        first.close()


def test_attach_after_close_and_use_after_close() -> None:
    """Attaching to a closed ring, writing to a closed writer and reading from a closed reader each raise
    RingClosedError."""
    writer = ShmRingWriter(1)
    reader = ShmRingReader.attach(writer.reader_handle(0))
    handle = writer.reader_handle(0)
    writer.close()
    with pytest.raises(RingClosedError, match="does not exist"):
        ShmRingReader.attach(handle)
    with pytest.raises(RingClosedError, match="writer cannot write"):
        writer.write(b"x")
    reader.close()
    with pytest.raises(RingClosedError, match=r"reader 0 .* is closed"):
        reader.read()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"n_readers": 0}, "n_readers"), ({"n_readers": 1, "slot_bytes": 0}, "slot_bytes"),
     ({"n_readers": 1, "n_slots": 1.5}, "n_slots"), ({"n_readers": 1, "warn_after_s": 0}, "warn_after_s"),
     ({"n_readers": 1, "recheck_s": -1.0}, "recheck_s")],
)  # fmt: skip
def test_writer_validates_its_arguments(kwargs: dict[str, float], field: str) -> None:
    """A bad constructor argument raises RingConfigError (an AsyncLLMError and a ValueError) naming it, before
    any segment is created; so does a rank outside the ring when asking for a reader's handle."""
    with pytest.raises(RingConfigError, match=rf"^{field}=") as caught:
        ShmRingWriter(**kwargs)  # type: ignore[arg-type]
    assert isinstance(caught.value, AsyncLLMError) and isinstance(caught.value, ValueError)
    with ShmRingWriter(2) as writer, pytest.raises(RingConfigError, match=r"rank=2 is invalid"):
        writer.reader_handle(2)


def test_spinner_stops_spinning_on_a_contended_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spin before sleeping: it returns as soon as the condition holds, gives up after spin_s, and once a
    yield took long (another process got the core) it skips spinning for a while, so a busy host costs a
    reader one wake-up per message rather than a lost time slice per poll (the bug: 10^5 messages took 119 s
    on 2 cores with 2 CPU hogs, 14 s with this)."""
    spinner = Spinner(spin_s=0.02)
    assert spinner.spin(lambda: True)
    start = time.monotonic()
    assert not spinner.spin(lambda: False)
    assert time.monotonic() - start < 0.5  # (sooner if this host is busy: that is the point)
    spinner = Spinner(spin_s=0.02)
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(0.001))  # as if another process ran meanwhile
    polls: list[None] = []
    assert not spinner.spin(lambda: bool(polls.append(None)))
    assert len(polls) == 1
    assert not spinner.spin(lambda: bool(polls.append(None)))  # quiet: no poll, no yield
    assert len(polls) == 1


def test_full_dev_shm_fails_at_construction_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """When /dev/shm cannot hold the ring (Docker's 64 MB default), the constructor raises RingNoSpaceError (an
    OSError, errno ENOSPC) naming --shm-size and leaves no segment behind, instead of a SIGBUS at the first write
    into a missing page."""

    def no_space(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(RingNoSpaceError, match=r"--shm-size") as caught:
        ShmRingWriter(2, slot_bytes=2**20, n_slots=64)
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, AsyncLLMError)


def test_write_takes_any_contiguous_buffer() -> None:
    """write() and write_parts() take bytes, bytearray, memoryview slices and typed arrays (sent as their bytes);
    a non-contiguous view is refused with TypeError rather than sent scrambled."""
    numbers = array.array("i", range(100))
    with ShmRingWriter(1, slot_bytes=64) as writer, ShmRingReader.attach(writer.reader_handle(0)) as reader:
        writer.write(numbers)
        writer.write_parts([bytearray(b"ab"), memoryview(b"xcdx")[1:3], numbers])
        assert reader.read() == numbers.tobytes()
        assert reader.read() == b"abcd" + numbers.tobytes()
        with pytest.raises(TypeError):
            writer.write(memoryview(b"abcdef")[::2])


def test_wait_for_readers_and_wait_until_read() -> None:
    """wait_for_readers() times out naming the ranks not attached yet and returns once all are;
    wait_until_read() returns once every reader has read everything written."""
    with ShmRingWriter(2) as writer:
        first = ShmRingReader.attach(writer.reader_handle(0))
        with pytest.raises(RingTimeoutError, match=r"readers \[1\] did not attach"):
            writer.wait_for_readers(timeout=0.05)
        second = ShmRingReader.attach(writer.reader_handle(1))
        writer.wait_for_readers(timeout=1)
        writer.write(b"m")
        with pytest.raises(RingTimeoutError, match="for every message to be read"):
            writer.wait_until_read(timeout=0.05)
        first.read(), second.read()
        writer.wait_until_read(timeout=1)
        first.close(), second.close()
