"""`DiskKVStore`: the disk tier, one file per KV block (this rank's shard) named by its block hash, in a
directory named by the engine's fingerprint (`kv_fingerprint.py`): a later engine on the same model and
settings finds them there, and no other engine reads them.

A file is a checksummed header and the block's bytes as a host slot holds them (`kv_file.py`, the format). A
64-bit hash may collide across restarts and engines sharing the directory: a read is asked for the digest its
block's prefix has, and a file with another is a miss. A background thread writes it from the slot its copy
landed in, into a temporary file of a name no other writer uses, then renames it over the final name: a reader
sees a whole file or none, and two engines writing one block race harmlessly. A read (in a reader process over
the host slots' shared memory, `kv_reader.py`, or on a few loader threads; beside the steps either way:
`load_async`) goes straight into a host slot and is checked whole before the block is used: a missing file is a
plain miss; a corrupted, truncated or foreign one is ignored with a warning, and its block is recomputed. No
fsync: a file torn by a crash fails its checksum.

The directory is bounded (`capacity_bytes`): oldest files out first, by modification time (a read refreshes
it), other engines' files counted too (rescanned every `_RESCAN_WRITES` writes).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from asyncllm.worker import kv_file
from asyncllm.worker.kv_host import HostKVPool
from asyncllm.worker.kv_reader import ReaderProcess

logger = logging.getLogger(__name__)

_RESCAN_WRITES = 1024
_STALE_TEMP_S = 600.0  # a temporary file this old was left by a writer that died
# Reads (page cache or disk into pinned slots) and their xxh3 checks release the GIL: they scale with cores,
# and a returning 8K-token history of an 8B model is over a gigabyte. At most 8: on a 16-core H100 machine, 8
# read 1.2 GB alone as fast as 16 (23-30 against 20-27 GB/s), and 16 slowed the step thread's restores beside
# them several times over (bench/RESULTS.md, the tenth session).
_LOAD_THREADS = max(2, min(8, os.cpu_count() or 4))
_temp_names = itertools.count()


class DiskKVStore:
    def __init__(
        self,
        directory: Path,
        fingerprint: bytes,
        pool: HostKVPool,
        capacity_bytes: int,
        load_threads: int | None = None,  # None: one a core, 2 to 8
        reader_process: bool = True,  # where the pool's slots are shared (`HostKVPool.shared_fd`)
    ) -> None:
        assert len(fingerprint) == 16
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self._pool = pool
        self.file_bytes = kv_file.HEADER_BYTES + pool.block_bytes
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
        threads = load_threads or _LOAD_THREADS
        self._loaders = ThreadPoolExecutor(threads, thread_name_prefix="asyncllm-kv-load")
        self._reader: ReaderProcess | None = None
        if reader_process and pool.shared_fd is not None:
            size = pool.host.numel()
            try:
                self._reader = ReaderProcess(
                    pool.shared_fd, size, directory, fingerprint, pool.block_bytes, threads, self._loaded
                )
            except OSError as exc:
                logger.warning("the KV disk tier's reader process did not start (%s): reads run in this process", exc)
        self._writer = threading.Thread(target=self._run, name="asyncllm-kv-disk", daemon=True)
        self._writer.start()

    @property
    def reader_pid(self) -> int | None:
        """The process reading the files (`kv_reader.py`); None where reads run on this process's threads."""
        reader = self._reader
        return reader.pid if reader is not None and reader.alive else None

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
        if self._reader is not None:
            self._reader.close()
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
        header = kv_file.header(self.fingerprint, block_hash, payload.data, digest)
        final = kv_file.path_of(self.directory, block_hash)
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
        reader = self._reader
        if reader is not None and reader.alive:
            return reader.submit(jobs, ready.synchronize if ready is not None else None)
        return [self._loaders.submit(self._load_after, ready, *job) for job in jobs]

    def load(self, jobs: list[tuple[int, int, bytes]]) -> list[bool]:
        """`load_async`, waited for."""
        return [future.result() for future in self.load_async(jobs, None)]

    def _load_after(self, ready: torch.cuda.Event | None, block_hash: int, slot: int, digest: bytes) -> bool:
        if ready is not None:
            ready.synchronize()
        return self._load_one(block_hash, slot, digest)

    def _load_one(self, block_hash: int, slot: int, digest: bytes) -> bool:
        path = kv_file.path_of(self.directory, block_hash)
        problem = kv_file.read_block(path, self._pool.slot(slot).numpy().data, self.fingerprint, block_hash, digest)
        return self._loaded(block_hash, path, problem)

    def _loaded(self, block_hash: int, path: Path, problem: str | None) -> bool:
        """Whether a read's block arrived intact (`kv_file.read_block`'s verdict), warned of when it did not."""
        if problem == kv_file.MISSING:
            return False  # never written, or evicted since: recomputed, nothing to warn about
        if problem is not None:
            logger.warning("KV cache file %s ignored (%s): its block is recomputed", path, problem)
            return False
        with self._cond:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        return True

    # ------------------------------------------------------------------ the directory
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
                if kv_file.NAME.match(entry.name):
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
            evicted.append(kv_file.path_of(self.directory, block_hash))
        return evicted


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
