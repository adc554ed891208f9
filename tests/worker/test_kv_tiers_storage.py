"""The KV tiers' storage on one rank: `HostKVPool` copies whole blocks (every layer's keys and values, as bytes)
to host slots and back, any dtype (FP8 codes included) and any order of blocks and slots; `DiskKVStore` writes a
slot to a file and reads it back into another slot, refuses a file whose bytes, length, header, fingerprint,
format version or prefix digest are wrong (with a warning), keeps the directory within its size (oldest files
out, a read counting as use), and drops or waits for a pending write when its slot is about to be reused."""

from __future__ import annotations

import logging
import os
import random
import signal
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncllm.worker.kv_disk import DiskKVStore
from asyncllm.worker.kv_host import HostKVPool

FINGERPRINT = bytes(range(16))


def digest(block_hash: int) -> bytes:
    """A stand-in for the digest of the prefix `block_hash` names (`block_hash.extend_block_digests`)."""
    return block_hash.to_bytes(16, "little")


def random_cache(
    num_layers: int,
    num_blocks: int,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: str = "cpu",
    stacked: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of random values; `stacked`: views of one allocation, layer after layer, as
    the engine allocates them (one copy moves a block of every layer), else a tensor each."""
    gen = torch.Generator().manual_seed(num_layers * 100 + num_blocks)
    if stacked:
        flat = torch.randn((2 * num_layers, num_blocks, *shape), generator=gen).to(dtype).to(device)
        return [(flat[2 * i], flat[2 * i + 1]) for i in range(num_layers)]

    def one() -> torch.Tensor:
        values = torch.randn((num_blocks, *shape), generator=gen).to(dtype)
        return values.to(device)

    return [(one(), one()) for _ in range(num_layers)]


@pytest.mark.parametrize("stacked", [False, True], ids=["a tensor a layer", "one allocation"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_go_to_host_and_come_back_whole(dtype: torch.dtype, stacked: bool) -> None:
    cache = random_cache(3, 11, (5, 2, 6), dtype, stacked=stacked)  # rows of 24, 12 and 6 bytes
    want = [(k.clone(), v.clone()) for k, v in cache]
    pool = HostKVPool(cache, num_slots=7, device=torch.device("cpu"))
    assert pool.block_bytes == 2 * 3 * 5 * 2 * 6 * torch.empty((), dtype=dtype).element_size()
    pool.to_host([(4, 6), (0, 2), (9, 3)])
    for layer, _ in cache:  # overwrite the blocks: only the host copies hold them now
        layer[[4, 0, 9]] = torch.zeros_like(layer[[4, 0, 9]])
    pool.to_device([(3, 1), (6, 10), (2, 5)])  # into other blocks, in another order
    for (k, v), (wk, wv) in zip(cache, want, strict=True):
        for src, dst in ((9, 1), (4, 10), (0, 5)):
            assert torch.equal(k[dst].view(torch.uint8), wk[src].view(torch.uint8))
            assert torch.equal(v[dst].view(torch.uint8), wv[src].view(torch.uint8))


@pytest.fixture(params=[False, True], ids=["threads", "reader process"])
def shared(request) -> bool:
    """Where the store reads: on threads of this process, or in its reader process over the slots' shared
    memory (Linux)."""
    if request.param and not hasattr(os, "memfd_create"):
        pytest.skip("the reader process needs memfd_create (Linux)")
    return request.param


def _store(tmp_path: Path, capacity_blocks: int = 100, shared: bool = False) -> tuple[HostKVPool, DiskKVStore]:
    cache = random_cache(2, 6, (4, 2, 8), torch.float32)
    pool = HostKVPool(cache, num_slots=4, device=torch.device("cpu"), shared=shared)
    pool.to_host([(0, 0), (1, 1), (2, 2), (3, 3)])
    file_bytes = 72 + pool.block_bytes  # a 72-byte header
    store = DiskKVStore(tmp_path, FINGERPRINT, pool, capacity_blocks * file_bytes)
    assert (store.reader_pid is not None) == shared
    return pool, store


def _written(store: DiskKVStore, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(store.on_disk()) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_written_block_reads_back_into_another_slot(tmp_path: Path, shared: bool) -> None:
    pool, store = _store(tmp_path, shared=shared)
    store.write([(0xDEAD, 1, digest(0xDEAD)), (2**64 - 1, 2, digest(2**64 - 1))], None)
    _written(store, 2)
    loads = [(0xDEAD, 3, digest(0xDEAD)), (2**64 - 1, 0, digest(2**64 - 1)), (0xBEEF, 0, digest(0xBEEF))]
    assert store.load(loads) == [True, True, False]  # the last: never written
    assert torch.equal(pool.slot(3), pool.slot(1))
    assert sorted(store.on_disk()) == [0xDEAD, 2**64 - 1]
    store.close()
    again = DiskKVStore(tmp_path, FINGERPRINT, pool, store.capacity_bytes)  # a later engine finds them
    assert sorted(again.on_disk()) == [0xDEAD, 2**64 - 1]
    again.close()


@pytest.mark.parametrize(
    ("damage", "warning"),
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
        (lambda b: b[:-5], "truncated"),
        (lambda b: b[:10], "truncated"),  # within the header
        (lambda b: b"", "truncated"),
        (lambda b: b + b"x", "longer than a block"),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "header's checksum"),
        (lambda b: b"JUNK" + b[4:], "not a KV block file"),
    ],
)
def test_a_damaged_file_is_refused_with_a_warning(tmp_path: Path, caplog, damage, warning: str, shared: bool) -> None:
    _, store = _store(tmp_path, shared=shared)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    path = next(tmp_path.glob("*.kvb"))
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        assert store.load([(7, 3, digest(7))]) == [False]
    assert warning in caplog.text
    store.close()


def test_a_directory_in_a_files_place_is_refused_with_a_warning(tmp_path: Path, caplog, shared: bool) -> None:
    _, store = _store(tmp_path, shared=shared)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    path = next(tmp_path.glob("*.kvb"))
    path.unlink()
    path.mkdir()
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        assert store.load([(7, 3, digest(7))]) == [False]
    assert "unreadable" in caplog.text
    store.close()


@pytest.mark.parametrize("cut", [0, 5], ids=["whole", "truncated"])
def test_reads_without_preadv_read_the_same(tmp_path: Path, monkeypatch, cut: int) -> None:
    """Where the platform has no `preadv`, a file is read a buffer at a time: the same blocks, the same refusals."""
    pool, store = _store(tmp_path)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    if cut:
        path = next(tmp_path.glob("*.kvb"))
        path.write_bytes(path.read_bytes()[:-cut])
    monkeypatch.delattr("os.preadv", raising=False)
    assert store.load([(7, 3, digest(7))]) == [not cut]
    if not cut:
        assert torch.equal(pool.slot(3), pool.slot(1))
    store.close()


class _Gate:
    """A stand-in for the CUDA event `load_async` waits on: fires when the test opens it."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def synchronize(self) -> None:
        self.open.wait(10)


def test_reads_wait_for_the_copies_before_them(tmp_path: Path, shared: bool) -> None:
    """A read fills its slot only once the copies issued before it landed (`ready`): until then the slot keeps
    what it held; and closing the store waits for the reads sent."""
    pool, store = _store(tmp_path, shared=shared)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    before = pool.slot(3).clone()
    gate = _Gate()
    waiting = store.load_async([(7, 3, digest(7))], gate)  # type: ignore[arg-type]
    time.sleep(0.2)
    assert not waiting[0].done() and torch.equal(pool.slot(3), before)
    threading.Timer(0.1, gate.open.set).start()
    store.close()  # with the read still out
    assert waiting[0].result(timeout=10) is True
    assert torch.equal(pool.slot(3), pool.slot(1))


@pytest.mark.parametrize("pad", [0, 1, 2])
def test_a_long_problem_in_any_script_is_reported(tmp_path: Path, caplog, shared: bool, pad: int) -> None:
    """A refusal's text (here the path, long and not ASCII, of a file that is a link loop) reaches the log,
    and the read is a miss, whichever side read it. Three-byte characters after 0-2 bytes of padding: the
    reader process's cut of a long text falls inside a character in two of the three."""
    directory = tmp_path.joinpath("a" * (pad + 1), *["€" * 80] * 5)  # 1,200 bytes of three-byte characters
    _, store = _store(directory, shared=shared)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    path = next(directory.glob("*.kvb"))
    path.unlink()
    path.symlink_to(path)  # a loop: opening it fails
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        assert store.load([(7, 3, digest(7)), (7, 2, digest(7))]) == [False, False]
    assert caplog.text.count("unreadable") == 2
    assert store.load([(8, 3, digest(8))]) == [False]  # the reader still answers
    store.close()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the reader process needs memfd_create (Linux)")
def test_a_dead_reader_process_leaves_misses_and_threads_read_on(tmp_path: Path, caplog) -> None:
    """Reads sent to a reader process that died are misses (their blocks recomputed), with a warning; later
    reads run on this process's threads and find the blocks."""
    pool, store = _store(tmp_path, shared=True)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    gate = _Gate()
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        waiting = store.load_async([(7, 3, digest(7))], gate)  # type: ignore[arg-type]
        pid = store.reader_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        gate.open.set()
        assert [f.result(timeout=10) for f in waiting] == [False]
    assert "reader process exited" in caplog.text
    assert store.reader_pid is None
    assert store.load([(7, 3, digest(7))]) == [True]
    assert torch.equal(pool.slot(3), pool.slot(1))
    store.close()


def test_another_engines_file_is_refused(tmp_path: Path, caplog, shared: bool) -> None:
    pool, store = _store(tmp_path, shared=shared)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    store.close()
    other = DiskKVStore(tmp_path, bytes(16), pool, store.capacity_bytes)  # another fingerprint, one directory
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        assert other.load([(7, 3, digest(7))]) == [False]
    assert "another model or settings" in caplog.text
    other.close()


def test_the_directory_keeps_its_size_oldest_out(tmp_path: Path, shared: bool) -> None:
    _, store = _store(tmp_path, capacity_blocks=3, shared=shared)
    for h in (1, 2, 3):
        store.write([(h, h % 4, digest(h))], None)
        _written(store, h)
        time.sleep(0.02)  # distinct modification times
    assert store.load([(1, 0, digest(1))]) == [True]  # a read counts as use: 2 is now the oldest
    store.write([(4, 3, digest(4))], None)
    deadline = time.monotonic() + 10
    while 4 not in store.on_disk() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(store.on_disk()) == [1, 3, 4] and sorted(p.stem for p in tmp_path.glob("*.kvb")) == [
        f"{h:016x}" for h in (1, 3, 4)
    ]
    store.close()


def test_a_slot_about_to_be_reused_drops_its_pending_write(tmp_path: Path, shared: bool) -> None:
    pool, store = _store(tmp_path, shared=shared)
    rng = random.Random(0)
    for _ in range(50):  # whichever way each race goes, a file holds the bytes its slot held when written
        slot = rng.randrange(4)
        before = pool.slot(slot).clone()
        block_hash = rng.randrange(1, 2**64)
        store.write([(block_hash, slot, digest(block_hash))], None)
        store.release(slot)
        pool.slot(slot).copy_(torch.randint(0, 255, before.shape, dtype=torch.uint8))
        if store.load([(block_hash, (slot + 1) % 4, digest(block_hash))]) == [True]:
            assert torch.equal(pool.slot((slot + 1) % 4), before)
    store.close()


def test_a_file_of_another_prefix_under_the_same_hash_is_refused(tmp_path: Path, caplog, shared: bool) -> None:
    """Regression (issue 44 review): a read trusted the 64-bit block hash in the file's name and header. A file
    well formed in every other way, but written for another prefix of that hash, is now a miss with a warning."""
    pool, store = _store(tmp_path, shared=shared)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        assert store.load([(7, 3, digest(8))]) == [False]
    assert "another prefix" in caplog.text
    assert store.load([(7, 3, digest(7))]) == [True] and torch.equal(pool.slot(3), pool.slot(1))
    store.close()


def test_a_file_of_an_older_format_is_refused(tmp_path: Path, caplog, shared: bool) -> None:
    """Format version 1 had no prefix digest: its files are ignored (never read as version 2's layout)."""
    _, store = _store(tmp_path, shared=shared)
    store.write([(7, 1, digest(7))], None)
    _written(store, 1)
    path = next(tmp_path.glob("*.kvb"))
    data = path.read_bytes()
    path.write_bytes(data[:4] + struct.pack("<I", 1) + data[8:])
    with caplog.at_level(logging.WARNING, logger="asyncllm"):
        assert store.load([(7, 3, digest(7))]) == [False]
    assert "format version 1" in caplog.text
    store.close()


def _shmem_kib(pid: int) -> int:
    """The process's resident shared memory (its mappings of the slots' pages), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    pytest.skip("no RssShmem in /proc/PID/status")


def test_the_reader_process_maps_only_the_slots_it_reads(tmp_path: Path) -> None:
    """The reader process fills its page tables one slot at a time, before each read writes that slot (so no
    read faults its slot in 4 KiB at a time), never for the whole pool: a review found an earlier version
    committing a CPU engine's whole pool, whose memory otherwise comes only as slots are written."""
    half = 512 << 10  # one slot: a layer's keys and values of one block, 1 MiB
    caches = [(torch.zeros(1, half, dtype=torch.uint8), torch.zeros(1, half, dtype=torch.uint8))]
    pool = HostKVPool(caches, 64, torch.device("cpu"), shared=True)  # 64 MiB
    store = DiskKVStore(tmp_path, FINGERPRINT, pool, 1 << 30)
    try:
        if store.reader_pid is None:
            pytest.skip("the reader process needs memfd_create (Linux)")
        pool.slot(0).random_(0, 255)
        store.write([(7, 0, digest(7))], None)
        _written(store, 1)
        assert _shmem_kib(store.reader_pid) < 1 << 10  # nothing mapped before a read
        assert store.load([(7, 40, digest(7))]) == [True]
        assert torch.equal(pool.slot(40), pool.slot(0))
        time.sleep(0.2)
        assert 1 << 10 <= _shmem_kib(store.reader_pid) < 8 << 10  # the slot read, not the pool's 64 MiB
    finally:
        store.close()
        pool.close()
