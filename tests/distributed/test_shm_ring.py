"""The shared-memory broadcast ring with real reader (and writer) processes: ordering, large messages, a slow
reader, wake-ups, closing, killed peers, idle CPU, and no /dev/shm entry left behind.

Reader processes use the spawn start method, as the engine's workers will; they run `_reader_main` below.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import queue
import random
import signal
import struct
import subprocess
import sys
import time
import zlib
from typing import Any

import pytest

from asyncllm.distributed import RingClosedError, RingHandle, RingTimeoutError, ShmRingReader, ShmRingWriter
from tests.fixtures.shm import no_leaked_segments, ring_segments  # noqa: F401 (fixture)

CTX = multiprocessing.get_context("spawn")
_STAMP = struct.Struct("<QI")  # stress messages: sequence number, crc32 of the body


pytestmark = pytest.mark.usefixtures("no_leaked_segments")  # every test leaves /dev/shm as it found it


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _reader_main(handle: RingHandle, results: Any, mode: str, options: dict[str, Any]) -> None:
    """A reader process: reads until the writer closes the ring, then reports on `results` per `mode`."""
    try:
        with ShmRingReader.attach(handle, **options.get("attach", {})) as reader:
            results.put(("ready", handle.rank, os.getpid()))
            if mode == "digests":  # every message's digest, in order
                out = []
                delay, slow_for = options.get("delay", 0.0), options.get("slow_for", 0)
                try:
                    while True:
                        out.append(digest(reader.read(timeout=60)))
                        if len(out) <= slow_for:
                            time.sleep(delay)
                except RingClosedError:
                    results.put(("done", handle.rank, out))
            elif mode == "check":  # each message carries its number and its body's crc32
                count, bad = 0, []
                try:
                    while True:
                        message = reader.read(timeout=60)
                        seq, crc = _STAMP.unpack_from(message)
                        if seq != count or crc != zlib.crc32(message[_STAMP.size :]):
                            bad.append((count, seq))
                        count += 1
                except RingClosedError:
                    results.put(("done", handle.rank, (count, bad[:10])))
            elif mode == "timed":  # when each message arrived and when the close was noticed
                events: list[tuple[str, float]] = []
                try:
                    while True:
                        reader.read()
                        events.append(("message", time.monotonic()))
                except RingClosedError as exc:
                    events.append((f"closed: {exc}", time.monotonic()))
                results.put(("done", handle.rank, events))
            elif mode == "hang":  # read one message, then never again (to be killed)
                reader.read(timeout=60)
                results.put(("read", handle.rank, None))
                time.sleep(600)
    except BaseException as exc:
        results.put(("error", handle.rank, repr(exc)))


class Readers:
    """Reader processes of one writer, and their reports."""

    def __init__(self, writer: ShmRingWriter, mode: str, ranks: list[int] | None = None, **options: Any) -> None:
        self.results: Any = CTX.Queue()
        ranks = list(range(writer._ring.layout.n_readers)) if ranks is None else ranks
        self.procs = {
            rank: CTX.Process(target=_reader_main, args=(writer.reader_handle(rank), self.results, mode, options))
            for rank in ranks
        }
        for proc in self.procs.values():
            proc.start()

    def expect(self, kind: str, timeout: float = 60.0) -> dict[int, Any]:
        """One `kind` report from every live reader: rank -> value."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(self.procs):
            try:
                what, rank, value = self.results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {kind!r} report from readers {sorted(set(self.procs) - set(got))}") from None
            assert what != "error", f"reader {rank} failed: {value}"
            assert what == kind, f"reader {rank} reported {what!r}, expected {kind!r}"
            got[rank] = value
        return got

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _messages(count: int, max_size: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice([0, 1, rng.randrange(max_size + 1)])) for _ in range(count)]


@pytest.mark.parametrize("n_readers", [1, 2, 8])
@pytest.mark.slow
def test_every_reader_gets_every_message_in_order(n_readers: int) -> None:
    """1, 2 and 8 reader processes each receive all messages, in order and intact; sizes span 0 bytes to
    several slots (continued messages), written whole or in parts, over many laps of a 4-slot ring."""
    messages = _messages(400, 3 * 1024, seed=n_readers)
    with ShmRingWriter(n_readers, slot_bytes=1024, n_slots=4) as writer:
        readers = Readers(writer, "digests")
        try:
            for i, message in enumerate(messages):
                if i % 3:
                    writer.write(message, timeout=30)
                else:
                    writer.write_parts([message[:7], bytearray(message[7:100]), memoryview(message)[100:]], timeout=30)
            writer.close()
            readers.expect("ready")
            got = readers.expect("done")
        finally:
            readers.stop()
    wanted = [digest(m) for m in messages]
    for rank in range(n_readers):
        assert got[rank] == wanted, f"reader {rank} got different messages"


@pytest.mark.slow
def test_hundred_thousand_messages_two_readers_check_content() -> None:
    """Stress: 10^5 messages (12-300 bytes, some continued over two slots) through an 8-slot ring (12,000+ laps);
    both reader processes check each message's sequence number and crc32 and count them."""
    n = 100_000
    rng = random.Random(0)
    bodies = [rng.randbytes(rng.randrange(300)) for _ in range(997)]  # reused: generating 10^5 costs seconds
    with ShmRingWriter(2, slot_bytes=256, n_slots=8) as writer:
        readers = Readers(writer, "check")
        try:
            for seq in range(n):
                body = bodies[seq % len(bodies)]
                writer.write_parts([_STAMP.pack(seq, zlib.crc32(body)), body], timeout=30)
            writer.close()
            readers.expect("ready")
            got = readers.expect("done")
        finally:
            readers.stop()
    assert got == {0: (n, []), 1: (n, [])}


@pytest.mark.slow
def test_fifty_megabyte_message_among_small_ones() -> None:
    """Messages far larger than a slot (50 MB over 64 KiB slots) and around the slot size (slot-1, 2 slots,
    2 slots + 1, empty) arrive intact and in order in two reader processes, mixed with small ones."""
    slot = 64 * 1024
    big = os.urandom(50 * 2**20)
    messages = [b"small", big, b"", os.urandom(slot - 1), os.urandom(2 * slot), os.urandom(2 * slot + 1), b"end"]
    with ShmRingWriter(2, slot_bytes=slot, n_slots=4) as writer:
        readers = Readers(writer, "digests")
        try:
            for message in messages:
                writer.write(message, timeout=60)
            writer.write_parts([big[:3], memoryview(big)[3 : 2**20], b"tail"], timeout=60)  # parts, no concatenation
            writer.close()
            readers.expect("ready")
            got = readers.expect("done")
        finally:
            readers.stop()
    wanted = [digest(m) for m in messages] + [digest(big[: 2**20] + b"tail")]
    assert got == {0: wanted, 1: wanted}


@pytest.mark.slow
def test_slow_reader_blocks_writer_without_loss() -> None:
    """A reader slower than the writer (5 ms per message for 60 messages) holds the writer back once the 4-slot
    ring is full: the writer takes at least ~(60 - 4) x 5 ms, and both readers get all 120 messages in order."""
    messages = _messages(120, 200, seed=7)
    with ShmRingWriter(2, slot_bytes=128, n_slots=4) as writer:
        slow = Readers(writer, "digests", ranks=[0], delay=0.005, slow_for=60)
        fast = Readers(writer, "digests", ranks=[1])
        try:
            slow.expect("ready"), fast.expect("ready")
            start = time.monotonic()
            for message in messages:
                writer.write(message, timeout=30)
            elapsed = time.monotonic() - start
            writer.close()
            got = slow.expect("done") | fast.expect("done")
        finally:
            slow.stop(), fast.stop()
    assert elapsed >= 56 * 0.005 * 0.9, f"the writer did not wait for the slow reader ({elapsed:.3f} s)"
    wanted = [digest(m) for m in messages]
    assert got == {0: wanted, 1: wanted}


@pytest.mark.slow
def test_sleeping_reader_is_woken_by_write_and_by_close() -> None:
    """A reader asleep on an idle ring (its re-check set to 10 s) gets a new message and then the writer's
    close within a second: the wake-up reaches it, not the re-check; the close raises a clear
    RingClosedError in the reader."""
    with ShmRingWriter(1) as writer:
        readers = Readers(writer, "timed", attach={"recheck_s": 10.0})
        try:
            readers.expect("ready")
            time.sleep(0.3)  # long past its spin: asleep
            sent = time.monotonic()
            writer.write(b"wake up")
            time.sleep(0.3)
            closed = time.monotonic()
            writer.close()
            (events,) = readers.expect("done").values()
        finally:
            readers.stop()
    (message, got_message), (close_error, got_close) = events
    assert message == "message" and got_message - sent < 1.0
    assert "closed by its writer" in close_error and got_close - closed < 1.0


@pytest.mark.slow
def test_reader_killed_with_sigkill_makes_writer_time_out_naming_it() -> None:
    """A reader killed with SIGKILL (left a zombie, not reaped) cannot hang the writer: once the ring is full the
    write's timeout fires, naming that reader, its pid and that it exited; the live reader is not blamed."""
    with ShmRingWriter(2, slot_bytes=64, n_slots=4) as writer:
        victim = Readers(writer, "hang", ranks=[0])
        other = Readers(writer, "digests", ranks=[1])
        try:
            (pid,) = victim.expect("ready").values()
            other.expect("ready")
            writer.write(b"first")
            victim.expect("read")
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
            with pytest.raises(RingTimeoutError) as caught:
                for i in range(10):
                    writer.write(b"more %d" % i, timeout=1.0)
            assert i == 4, "the ring's 3 free slots and the one the dead reader had read were used first"
            message = str(caught.value)
            assert f"reader 0 (pid {pid}, exited)" in message and "reader 1" not in message
            writer.close()
            other.expect("done")
        finally:
            victim.stop(), other.stop()


_WRITER_SCRIPT = """
import json, sys, time
from asyncllm.distributed import ShmRingWriter
writer = ShmRingWriter(1, slot_bytes=64, n_slots=4)
handle = writer.reader_handle(0)
print(json.dumps([handle.name, handle.n_readers, handle.n_slots, handle.slot_bytes, handle.rank]), flush=True)
writer.write(b"one")
writer.write(b"two")
time.sleep(600)
"""


def test_writer_killed_reader_raises_and_segment_is_removed() -> None:
    """A writer process killed with SIGKILL: its reader first gets the messages written before, then a clear
    RingClosedError saying the writer exited (within a few re-checks); the dead writer's resource tracker
    removes the segment."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        handle = RingHandle(*json.loads(proc.stdout.readline()))
        with ShmRingReader.attach(handle) as reader:
            assert [reader.read(timeout=10), reader.read(timeout=10)] == [b"one", b"two"]
            proc.kill()
            proc.wait()
            start = time.monotonic()
            with pytest.raises(RingClosedError, match=rf"writer .*\(pid {proc.pid}\) exited without closing"):
                reader.read(timeout=10)
            assert time.monotonic() - start < 1.0
        deadline = time.monotonic() + 10
        while handle.name in ring_segments() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handle.name not in ring_segments(), "the crashed writer's segment was not removed"
    finally:
        proc.kill()
        proc.wait()


_READER_SCRIPT = """
import sys
from asyncllm.distributed import RingHandle, ShmRingReader
reader = ShmRingReader.attach(RingHandle(sys.argv[1], 2, 4, 64, 0))
print(reader.read(timeout=10).decode(), flush=True)
# exits without close(): Python's resource tracker of this process must not unlink the segment
"""


def test_reader_process_exit_leaves_segment_for_the_others() -> None:
    """A reader started as an unrelated process (its own resource tracker) that exits without closing leaves
    the segment in place: another reader can still attach and read, and only the writer's close removes it."""
    with ShmRingWriter(2, slot_bytes=64, n_slots=4) as writer:
        writer.write(b"hello")
        out = subprocess.run(
            [sys.executable, "-c", _READER_SCRIPT, writer.name], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "hello"
        time.sleep(0.2)
        assert writer.name in ring_segments()
        with ShmRingReader.attach(writer.reader_handle(1)) as other:
            assert other.read(timeout=5) == b"hello"
    assert writer.name not in ring_segments()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.slow
def test_idle_reader_uses_almost_no_cpu() -> None:
    """A reader process blocked on an idle ring for 1 s sleeps: under 5% of a core (a spinning one uses 100%)."""
    with ShmRingWriter(1) as writer:
        readers = Readers(writer, "digests")
        try:
            (pid,) = readers.expect("ready").values()
            time.sleep(0.2)
            before, start = _cpu_seconds(pid), time.monotonic()
            time.sleep(1.0)
            used = (_cpu_seconds(pid) - before) / (time.monotonic() - start)
            writer.close()
            readers.expect("done")
        finally:
            readers.stop()
    assert used < 0.05, f"idle reader used {used:.0%} of a core"


def test_import_leaves_torch_and_numpy_out() -> None:
    """The ring is plain standard library: importing it in a fresh interpreter imports neither torch nor numpy."""
    code = "import sys, asyncllm.distributed; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
