"""The disk tier's file format (`kv_disk.py`), torch-free so that the reader process (`kv_reader.py`) can use it.

A file is a header (magic, format version, the fingerprint, the block hash, the payload's length and its
xxh3-64, the 128-bit digest of the block's whole token prefix, then the header's own xxh3-64) and the block's
bytes as a host slot holds them. `read_block` reads one into a slot's memory and says what is wrong with it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import struct
from pathlib import Path

import xxhash

MAGIC = b"AKVB"
VERSION = 2  # 2: the prefix digest (version 1 files are ignored, with a warning)
# magic, version, fingerprint, block hash, payload bytes, payload xxh3-64, prefix digest
HEADER = struct.Struct("<4sI16sQQQ16s")
HEADER_SUM = struct.Struct("<Q")  # xxh3-64 of the header before it
HEADER_BYTES = HEADER.size + HEADER_SUM.size
NAME = re.compile(r"^[0-9a-f]{16}\.kvb$")
MISSING = ""  # `read_block`: no such file (never written, or evicted since): a plain miss, nothing to warn about
_UTIME_FD = os.utime in os.supports_fd


def path_of(directory: Path, block_hash: int) -> Path:
    return directory / f"{block_hash:016x}.kvb"


def header(fingerprint: bytes, block_hash: int, payload: memoryview, digest: bytes) -> bytes:
    """The header a file of `payload` (a slot's bytes) starts with."""
    head = HEADER.pack(
        MAGIC, VERSION, fingerprint, block_hash, payload.nbytes, xxhash.xxh3_64_intdigest(payload), digest
    )
    return head + HEADER_SUM.pack(xxhash.xxh3_64_intdigest(head))


def read_block(path: Path, target: memoryview, fingerprint: bytes, block_hash: int, digest: bytes) -> str | None:
    """Read the file at `path` into `target` (a slot's bytes) and check it whole: None when it holds that
    block of that prefix intact (its modification time then refreshed: the last to be evicted), `MISSING` when
    there is no such file, else what is wrong with it.

    Few system calls and no file object: where threads of the engine's process read, each call gives the GIL
    up and takes it back while the step thread waits for every take."""
    head = bytearray(HEADER_BYTES)
    extra = bytearray(1)  # a byte past the payload: the file is longer than a block
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        return f"unreadable: {exc}"
    try:
        n = read_into(fd, [head, target, extra])
        found = bytes(head[: min(n, HEADER_BYTES)])
        problem, payload_sum = _header_problem(found, fingerprint, block_hash, digest, target.nbytes)
        body = n - HEADER_BYTES
        if problem is None and body != target.nbytes:
            problem = "truncated" if body < target.nbytes else "longer than a block"
        elif problem is None and xxhash.xxh3_64_intdigest(target) != payload_sum:
            problem = "its checksum does not match its bytes"
        if problem is None:
            with contextlib.suppress(OSError):
                os.utime(fd if _UTIME_FD else path)
        return problem
    except OSError as exc:
        return f"unreadable: {exc}"
    finally:
        os.close(fd)


def read_into(fd: int, buffers: list[bytearray | memoryview]) -> int:
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


def _header_problem(
    head: bytes, fingerprint: bytes, block_hash: int, digest: bytes, block_bytes: int
) -> tuple[str | None, int]:
    """(what is wrong with a file's header, or None; the payload's checksum it gives)."""
    if len(head) < HEADER_BYTES:
        return "truncated", 0
    if head[:4] != MAGIC:
        return "not a KV block file", 0
    version = struct.unpack_from("<I", head, 4)[0]
    if version != VERSION:  # another layout: nothing past the version is read
        return f"format version {version}, not {VERSION}", 0
    _, _, found_fingerprint, found_hash, size, payload_sum, found_digest = HEADER.unpack_from(head)
    if HEADER_SUM.unpack_from(head, HEADER.size)[0] != xxhash.xxh3_64_intdigest(head[: HEADER.size]):
        return "its header's checksum does not match", 0
    if found_fingerprint != fingerprint:
        return "written for another model or settings", 0
    if found_hash != block_hash:
        return f"it holds block {found_hash:016x}", 0
    if size != block_bytes:
        return f"a block of {size} bytes, not {block_bytes}", 0
    if found_digest != digest:
        return "it holds another prefix's KV under the same 64-bit hash", 0
    return None, payload_sum
