"""The disk tier's reads in a process of their own (`ReaderProcess`), over the host slots' shared memory.

Why a process: in the engine's process every reader thread takes the GIL back after each system call, and the
step thread, which takes it back after each torch op it launches, waits behind them. On an H100 machine the 512
reads of an 8K-token history (1.2 GB) took 108-172 ms beside the steps against 40-61 ms alone, and the step
restoring the first blocks read took up to 149 ms to issue its copies (bench/RESULTS.md, the tenth session).
The reader process has its own GIL: the engine's side is one thread that sends each step's jobs and one that
takes the results, a few at a time.

The child maps the slots' memory file (`HostKVPool.shared_fd`), reads each job's file straight into its slot on
a few threads (`kv_file.read_block`), and answers each job with its verdict. Jobs and answers are fixed-size
records on its stdin and stdout. If the child dies, its outstanding reads are misses (their blocks are
recomputed) and the store reads on threads from then on. Torch-free: the child imports nothing heavy.

Child: `python -c _BOOT WORKER_DIR FD SIZE DIRECTORY FINGERPRINT_HEX SLOT_BYTES THREADS`; it answers one
byte once it has mapped the slots, and the engine waits for that byte before it serves.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

if not __package__:  # the child (`_BOOT`): its sibling alone, not the package (it starts in half the time)
    import kv_file  # type: ignore[import-not-found]
else:
    from asyncllm.worker import kv_file

logger = logging.getLogger(__name__)

_JOB = struct.Struct("<QQQ16s")  # job id, block hash, slot, prefix digest
_ANSWER = struct.Struct("<QBH")  # job id, verdict, the problem's length in bytes (UTF-8, after the record)
_INTACT, _MISSING, _PROBLEM = 0, 1, 2
_READY = b"R"  # the child's first byte: the slots are mapped
_MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only where its build saw it
_START_TIMEOUT_S = 30.0
# The child's command: this folder last on its path (no module here shadows another), this file as a module.
_BOOT = "import sys; sys.path.append(sys.argv[1]); import kv_reader; kv_reader.main(sys.argv[2:])"

Job = tuple[int, int, bytes]  # (block hash, slot, prefix digest)
Verdict = Callable[[int, Path, "str | None"], bool]  # (block hash, path, kv_file.read_block's verdict) -> arrived


class ReaderProcess:
    """The engine's side: `submit` a step's jobs, each answered by a future of whether its block arrived."""

    def __init__(
        self,
        shared_fd: int,
        size: int,
        directory: Path,
        fingerprint: bytes,
        slot_bytes: int,
        threads: int,
        verdict: Verdict,
    ) -> None:
        argv = [sys.executable, "-c", _BOOT, str(Path(__file__).parent), str(shared_fd), str(size), str(directory)]
        argv += [fingerprint.hex(), str(slot_bytes), str(threads)]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(shared_fd,))
        started = False
        try:
            started = _ready(self._proc, _START_TIMEOUT_S)
        except Exception as exc:  # the store then reads on threads
            raise OSError(f"waiting for it failed: {exc!r}") from exc
        finally:
            if not started:
                self._proc.kill()
                self._proc.communicate()  # reaped, its pipes closed
        if not started:
            code = self._proc.returncode
            raise OSError(f"it exited with code {code} before it was ready" if code else "it did not start in time")
        self._directory = directory
        self._verdict: Verdict | None = verdict  # dropped at close: it holds the store, and the store holds this
        self._closing = False
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[int, Future[bool] | None]] = {}  # job id -> (block hash, its future)
        self._dead = False
        self._outbox: queue.SimpleQueue[tuple[Callable[[], None] | None, bytes] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send, name="asyncllm-kv-read-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive, name="asyncllm-kv-read-receive", daemon=True)
        self._sender.start()
        self._receiver.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._dead

    def submit(self, jobs: list[Job], ready: Callable[[], None] | None) -> list[Future[bool]]:
        """Read each job's block into its slot once `ready()` returns (the copies into or out of those slots
        issued before have landed; None: none is running)."""
        futures: list[Future[bool]] = []
        records = bytearray()
        with self._lock:
            for block_hash, slot, digest in jobs:
                job_id = next(self._ids)
                future: Future[bool] = Future()
                futures.append(future)
                if self._dead:
                    future.set_result(False)
                    continue
                self._waiting[job_id] = (block_hash, future)
                records += _JOB.pack(job_id, block_hash, slot, digest)
        if records:
            self._outbox.put((ready, bytes(records)))
        return futures

    def close(self, timeout: float = 30.0) -> None:
        """Let the child finish the reads sent, then stop it."""
        self._closing = True
        self._outbox.put(None)
        self._sender.join(timeout)
        self._receiver.join(timeout)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._fail_waiting()
        self._verdict = None
        if not self._receiver.is_alive() and self._proc.stdout is not None:
            self._proc.stdout.close()

    def _send(self) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            while (item := self._outbox.get()) is not None:
                ready, records = item
                if ready is not None:
                    ready()
                stdin.write(records)
                stdin.flush()
        except (OSError, ValueError):  # the child is gone: the receiver fails what waits
            pass
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    def _receive(self) -> None:
        stdout = self._proc.stdout
        assert stdout is not None
        buffer = bytearray()
        try:
            while chunk := os.read(stdout.fileno(), 1 << 16):
                buffer += chunk
                while len(buffer) >= _ANSWER.size:
                    job_id, verdict, length = _ANSWER.unpack_from(buffer)
                    end = _ANSWER.size + length
                    if len(buffer) < end:
                        break
                    problem = bytes(buffer[_ANSWER.size : end]).decode(errors="replace")
                    del buffer[:end]
                    self._answer(
                        job_id, kv_file.MISSING if verdict == _MISSING else None if verdict == _INTACT else problem
                    )
        except OSError:
            pass  # the pipe closed under it (close() after a timeout)
        finally:
            self._fail_waiting()

    def _answer(self, job_id: int, problem: str | None) -> None:
        with self._lock:
            block_hash, future = self._waiting.pop(job_id, (0, None))
        if future is None:  # failed already (close's timeout)
            return
        arrived = False
        try:
            verdict = self._verdict
            if verdict is not None:
                arrived = verdict(block_hash, kv_file.path_of(self._directory, block_hash), problem)
        except Exception:  # every future is resolved, whatever the bookkeeping does
            logger.exception("the KV disk tier's verdict on block %016x failed: it is recomputed", block_hash)
        future.set_result(arrived)

    def _fail_waiting(self) -> None:
        """The child is gone: every read not answered is a miss, and later jobs are answered at once."""
        with self._lock:
            unexpected = not self._dead and not self._closing
            self._dead = True
            waiting, self._waiting = self._waiting, {}
        if unexpected:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(1.0)  # its stdout closed: it is exiting; reaped, not left a zombie
            logger.warning(
                "the KV disk tier's reader process exited (code %s) with %d reads out: their blocks are "
                "recomputed, and later reads run in this process",
                self._proc.poll(),
                len(waiting),
            )
        for _, future in waiting.values():
            if future is not None:
                future.set_result(False)


def _ready(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether the child answered its ready byte within `timeout` seconds."""
    stdout = proc.stdout
    assert stdout is not None
    poller = select.poll()  # not select.select: a descriptor past 1023 is fine
    poller.register(stdout.fileno(), select.POLLIN)
    if not poller.poll(timeout * 1000):
        return False
    return os.read(stdout.fileno(), 1) == _READY  # unbuffered: the answers follow on the fd


# ---------------------------------------------------------------------------------------------- the child


class _PageTables:
    """Fills this process's page tables for a slot, once, before the first read that writes it (which commits
    its pages anyway, pinned or not). This process's mapping of the slots is new: otherwise that read's first
    write faults once per 4 KiB page, which took the reads on a 2-core VM from 0.12 to 0.40 s a GiB, while
    MADV_POPULATE_WRITE (Linux 5.14 or newer; on an older kernel the pages fault in as before) maps 1 GiB in
    ~0.06 s. Called through ctypes, which lets go of the GIL, not `mmap.madvise`, which holds it: the other
    reading threads go on meanwhile. (Filling the whole pool from the start, on a thread of its own through
    `mmap.madvise`, held the reads back on an H100 host: the first came in after 81 ms, not 8; and filling a
    slot again costs as much as a quarter of a read: bench/RESULTS.md, twelfth session.)"""

    def __init__(self, mapping: mmap.mmap, slot_bytes: int) -> None:
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self._size, self._step = len(mapping), slot_bytes
        self._filled = bytearray(self._size // slot_bytes + 1)
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._madvise.restype = ctypes.c_int

    def fill(self, slot: int) -> None:
        if self._filled[slot]:
            return
        self._filled[slot] = 1  # a failure (an older kernel's EINVAL) leaves the pages to fault in as before
        start = slot * self._step
        first = start - start % mmap.PAGESIZE
        self._madvise(self._base + first, min(start + self._step, self._size) - first, _MADV_POPULATE_WRITE)


def main(argv: list[str]) -> None:
    fd, size, directory, fingerprint_hex, slot_bytes, threads = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C stops the engine, which closes stdin
    mapping = mmap.mmap(int(fd), int(size), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    slots = memoryview(mapping)
    root, fingerprint, step = Path(directory), bytes.fromhex(fingerprint_hex), int(slot_bytes)
    lock = threading.Lock()
    page_tables = _PageTables(mapping, step)
    os.write(1, _READY)

    def read(job_id: int, block_hash: int, slot: int, digest: bytes) -> None:
        try:
            page_tables.fill(slot)
            target = slots[slot * step : (slot + 1) * step]
            problem = kv_file.read_block(kv_file.path_of(root, block_hash), target, fingerprint, block_hash, digest)
        except Exception as exc:  # every job is answered: the engine waits for each
            problem = f"the reader failed: {exc!r}"
        if problem is None:
            answer = _ANSWER.pack(job_id, _INTACT, 0)
        elif problem == kv_file.MISSING:
            answer = _ANSWER.pack(job_id, _MISSING, 0)
        else:
            text = problem.encode()[:1000].decode(errors="ignore").encode()  # whole characters
            answer = _ANSWER.pack(job_id, _PROBLEM, len(text)) + text
        with lock:
            os.write(1, answer)

    buffer = bytearray()
    with ThreadPoolExecutor(int(threads), thread_name_prefix="asyncllm-kv-read") as pool:
        while chunk := os.read(0, 1 << 16):
            buffer += chunk
            whole = len(buffer) - len(buffer) % _JOB.size
            for record in _JOB.iter_unpack(bytes(buffer[:whole])):
                pool.submit(read, *record)
            del buffer[:whole]
    # stdin closed and every read answered: the process exits, and with it the mapping
