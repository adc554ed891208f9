"""`DiskKVStore`: the disk tier, one file per KV block (this rank's shard) named by its block hash, in a
directory named by the engine's fingerprint (`kv_fingerprint.py`): a later engine on the same model and
settings finds them there, and no other engine reads them.

A file is a header (magic, format version, the fingerprint, the block hash, the payload's length and its
xxh3-64, the 128-bit digest of the block's whole token prefix, then the header's own xxh3-64) and the block's
bytes as a host slot holds them (`kv_host.py`). A 64-bit hash may collide across restarts and engines sharing
the directory: a read is asked for the digest its block's prefix has, and a file with another is a miss. A
background thread writes it from the slot its copy landed in, into a temporary file of a name no other writer
uses, then renames it over the final name: a reader sees a whole file or none, and two engines writing one
block race harmlessly. A read (on a few loader threads, beside the steps: `load_async`) goes straight into a
host slot and is checked whole before the block is used: a missing file is a plain miss; a corrupted, truncated
or foreign one is ignored with a warning, and its block is recomputed. No fsync: a file torn by a crash fails
its checksum.

The directory is bounded (`capacity_bytes`): oldest files out first, by modification time (a read refreshes
it), other engines' files counted too (rescanned every `_RESCAN_WRITES` writes).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash

from asyncllm.worker.kv_host import HostKVPool

logger = logging.getLogger(__name__)

_MAGIC = b"AKVB"
_VERSION = 2  # 2: the prefix digest (version 1 files are ignored, with a warning)
# magic, version, fingerprint, block hash, payload bytes, payload xxh3-64, prefix digest
_HEADER = struct.Struct("<4sI16sQQQ16s")
_HEADER_SUM = struct.Struct("<Q")  # xxh3-64 of the header before it
_NAME = re.compile(r"^[0-9a-f]{16}\.kvb$")
_RESCAN_WRITES = 1024
_STALE_TEMP_S = 600.0  # a temporary file this old was left by a writer that died
# Reads (page cache or disk into pinned slots) and their xxh3 checks release the GIL: they scale with cores,
# and a returning 8K-token history of an 8B model is over a gigabyte. At most 8: on a 16-core H100 machine, 8
# read 1.2 GB alone as fast as 16 (23-30 against 20-27 GB/s), and 16 slowed the step thread's restores beside
# them several times over (bench/RESULTS.md, the tenth session).
_LOAD_THREADS = max(2, min(8, os.cpu_count() or 4))
_UTIME_FD = os.utime in os.supports_fd
_temp_names = itertools.count()


class DiskKVStore:
    def __init__(
        self,
        directory: Path,
        fingerprint: bytes,
        pool: HostKVPool,
        capacity_bytes: int,
        load_threads: int | None = None,  # None: one a core, 2 to 8
    ) -> None:
        assert len(fingerprint) == 16
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self._pool = pool
        self.file_bytes = _HEADER.size + _HEADER_SUM.size + pool.block_bytes
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[int, int] = OrderedDict()  # block hash -> file size, oldest first
        self._total = 0
        self._cond = threading.Condition()
        self._pending: OrderedDict[int, tuple[int, bytes, torch.cuda.Event | None]] = OrderedDict()  # slot -> job
        self._busy: int | None = None  # the slot the writer is reading
        self._closed = False
        self._writes = 0
        self._failures = 0
        self._rescan()
        self._loaders = ThreadPoolExecutor(load_threads or _LOAD_THREADS, thread_name_prefix="asyncllm-kv-load")
        self._writer = threading.Thread(target=self._run, name="asyncllm-kv-disk", daemon=True)
        self._writer.start()

    @property
    def capacity_blocks(self) -> int:
        return max(1, self.capacity_bytes // self.file_bytes)

    def on_disk(self) -> tuple[int, ...]:
        """The block hashes on disk now, oldest first."""
        with self._cond:
            return tuple(self._files)

    # ------------------------------------------------------------------ writes (background)
    def write(self, jobs: list[tuple[int, int, bytes]], ready: torch.cuda.Event | None) -> None:
        """Write each (block hash, slot, prefix digest) of `jobs` once `ready` fires (None: the slots are filled
        already). At most one job per slot is queued: a slot's copy and its write come from one step."""
        with self._cond:
            for block_hash, slot, digest in jobs:
                self._pending[slot] = (block_hash, digest, ready)
            self._cond.notify_all()

    def release(self, slot: int) -> None:
        """The slot is about to be overwritten: its write, if not started, is dropped; if running, waited for."""
        with self._cond:
            self._pending.pop(slot, None)
            while self._busy == slot:
                self._cond.wait()

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued writes (at most `timeout` seconds), then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join(timeout)
        if self._writer.is_alive():
            logger.warning("the KV disk tier's writes did not finish within %.0f s: some blocks were not kept", timeout)
        self._loaders.shutdown(wait=True)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                slot, (block_hash, digest, ready) = self._pending.popitem(last=False)
                self._busy = slot
            try:
                if ready is not None:
                    ready.synchronize()
                self._write_file(block_hash, digest, self._pool.slot(slot))
            except OSError as exc:  # a full or read-only disk: the block just stays off disk
                self._failures += 1
                if self._failures == 1 or self._failures % 1000 == 0:
                    logger.warning(
                        "writing a KV block to %s failed (%d so far): %s", self.directory, self._failures, exc
                    )
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _write_file(self, block_hash: int, digest: bytes, slot: torch.Tensor) -> None:
        payload = slot.numpy()  # the pinned slot's bytes, no copy
        payload_sum = xxhash.xxh3_64_intdigest(payload.data)
        header = _HEADER.pack(_MAGIC, _VERSION, self.fingerprint, block_hash, payload.nbytes, payload_sum, digest)
        header += _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(header))
        final = self._path(block_hash)
        temp = self.directory / f".{block_hash:016x}.{os.getpid()}.{threading.get_ident()}.{next(_temp_names)}.tmp"
        try:
            with open(temp, "wb") as f:
                f.write(header)
                f.write(payload.data)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        with self._cond:
            self._total += len(header) + payload.nbytes - self._files.pop(block_hash, 0)
            self._files[block_hash] = len(header) + payload.nbytes
            self._writes += 1
            rescan = self._writes % _RESCAN_WRITES == 0
            evicted = [] if rescan else self._evict()
        if rescan:
            self._rescan()
        _unlink(evicted)

    # ------------------------------------------------------------------ reads (loader threads)
    def load_async(self, jobs: list[tuple[int, int, bytes]], ready: torch.cuda.Event | None) -> list[Future[bool]]:
        """Start reading each (block hash, slot, prefix digest) of `jobs` into its slot, once `ready` fires (the
        copies into or out of those slots issued before have landed; None: none is running). Each future says
        whether its block arrived intact and holds that prefix's KV."""
        return [self._loaders.submit(self._load_after, ready, *job) for job in jobs]

    def load(self, jobs: list[tuple[int, int, bytes]]) -> list[bool]:
        """`load_async`, waited for."""
        return [future.result() for future in self.load_async(jobs, None)]

    def _load_after(self, ready: torch.cuda.Event | None, block_hash: int, slot: int, digest: bytes) -> bool:
        if ready is not None:
            ready.synchronize()
        return self._load_one(block_hash, slot, digest)

    def _load_one(self, block_hash: int, slot: int, digest: bytes) -> bool:
        # Few system calls and no file object: each call gives the GIL up and takes it back, and the step
        # thread beside the readers waits for every take (measured: a restart's reads ran at a third of their
        # speed alone).
        path = self._path(block_hash)
        target = self._pool.slot(slot).numpy()
        head = bytearray(_HEADER.size + _HEADER_SUM.size)
        extra = bytearray(1)  # a byte past the payload: the file is longer than a block
        problem = None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except FileNotFoundError:
            return False  # never written, or evicted since: recomputed, nothing to warn about
        except OSError as exc:
            problem = f"unreadable: {exc}"
        else:
            try:
                n = _read_into(fd, [head, target.data.cast("B"), extra])
                problem, payload_sum = self._check_header(bytes(head[: min(n, len(head))]), block_hash, digest)
                body = n - len(head)
                if problem is None and body != target.nbytes:
                    problem = "truncated" if body < target.nbytes else "longer than a block"
                elif problem is None and xxhash.xxh3_64_intdigest(target.data) != payload_sum:
                    problem = "its checksum does not match its bytes"
                if problem is None:
                    with contextlib.suppress(OSError):
                        os.utime(fd if _UTIME_FD else path)  # recently used: the last to be evicted
            except OSError as exc:
                problem = f"unreadable: {exc}"
            finally:
                os.close(fd)
        if problem is not None:
            logger.warning("KV cache file %s ignored (%s): its block is recomputed", path, problem)
            return False
        with self._cond:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        return True

    def _check_header(self, head: bytes, block_hash: int, digest: bytes) -> tuple[str | None, int]:
        """(what is wrong with a file's header, or None; the payload's checksum it gives)."""
        if len(head) < _HEADER.size + _HEADER_SUM.size:
            return "truncated", 0
        if head[:4] != _MAGIC:
            return "not a KV block file", 0
        version = struct.unpack_from("<I", head, 4)[0]
        if version != _VERSION:  # another layout: nothing past the version is read
            return f"format version {version}, not {_VERSION}", 0
        _, _, fingerprint, found_hash, size, payload_sum, found_digest = _HEADER.unpack_from(head)
        if _HEADER_SUM.unpack_from(head, _HEADER.size)[0] != xxhash.xxh3_64_intdigest(head[: _HEADER.size]):
            return "its header's checksum does not match", 0
        if fingerprint != self.fingerprint:
            return "written for another model or settings", 0
        if found_hash != block_hash:
            return f"it holds block {found_hash:016x}", 0
        if size != self._pool.block_bytes:
            return f"a block of {size} bytes, not {self._pool.block_bytes}", 0
        if found_digest != digest:
            return "it holds another prefix's KV under the same 64-bit hash", 0
        return None, payload_sum

    # ------------------------------------------------------------------ the directory
    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}.kvb"

    def _rescan(self) -> None:
        """What is on disk now (other engines write here too), oldest first; stale temporary files removed."""
        found: list[tuple[float, int, int]] = []
        now = time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    stat = entry.stat()
                except OSError:
                    continue  # removed meanwhile
                if _NAME.match(entry.name):
                    found.append((stat.st_mtime, int(entry.name[:16], 16), stat.st_size))
                elif entry.name.endswith(".tmp") and now - stat.st_mtime > _STALE_TEMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        found.sort()
        with self._cond:
            self._files = OrderedDict((h, size) for _, h, size in found)
            self._total = sum(size for _, _, size in found)
            evicted = self._evict()
        _unlink(evicted)

    def _evict(self) -> list[Path]:
        """Drop the oldest files from the count until it is within capacity (under the lock); their paths."""
        evicted = []
        while self._total > self.capacity_bytes and self._files:
            block_hash, size = self._files.popitem(last=False)
            self._total -= size
            evicted.append(self._path(block_hash))
        return evicted


def _read_into(fd: int, buffers: list[bytearray | memoryview]) -> int:
    """Fill `buffers` in order from the start of the file `fd` until they are full or the file ends (one
    `preadv` where there is one); the bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    done = 0
    while views:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, views, done)
        else:  # one buffer a call, from the file's position (its start, then where the last read stopped)
            n = io.FileIO(fd, closefd=False).readinto(views[0]) or 0
        if n == 0:
            break
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return done


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
