"""The disk tier's reads beside the steps, on one rank (CPU, where they run on loader threads as on CUDA):
`DiskKVStore.load_async` starts reading only once the copies it is told to wait for have landed, and
`WorkerKVTiers` reports the reads in the order the steps sent them, the leading ones finished in whichever
later step finds them so (a step of no sequences waits a little for them; a step after one that started reads
comes through it even without copies of its own)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from asyncllm.step import KVTransfers
from asyncllm.worker.kv_disk import DiskKVStore
from asyncllm.worker.kv_host import HostKVPool
from asyncllm.worker.kv_tiers import WorkerKVTiers
from tests.worker.test_kv_tiers_storage import FINGERPRINT, _written, digest, random_cache


class Gate:
    """Stands in for the event of copies still in flight: `synchronize` blocks until `open`."""

    def __init__(self) -> None:
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def synchronize(self) -> None:
        assert self._open.wait(10), "the gate was never opened"


def _tiers(tmp_path: Path) -> tuple[HostKVPool, DiskKVStore]:
    pool = HostKVPool(random_cache(2, 8, (4, 2, 8), torch.float32), num_slots=8, device=torch.device("cpu"))
    pool.to_host([(b, b) for b in range(4)])
    store = DiskKVStore(tmp_path, FINGERPRINT, pool, 1 << 30)
    store.write([(100 + s, s, digest(100 + s)) for s in range(4)], None)
    _written(store, 4)
    return pool, store


def test_a_read_starts_once_the_copies_before_it_landed(tmp_path: Path) -> None:
    pool, store = _tiers(tmp_path)
    gate = Gate()
    futures = store.load_async([(100, 5, digest(100)), (101, 6, digest(999))], gate)  # type: ignore[arg-type]
    assert not any(f.done() for f in futures) and not torch.equal(pool.slot(5), pool.slot(0))
    gate.open()
    assert [f.result(timeout=10) for f in futures] == [True, False]  # the second: another prefix's digest
    assert torch.equal(pool.slot(5), pool.slot(0))
    store.close()


def test_reads_are_reported_by_later_steps_oldest_first(tmp_path: Path) -> None:
    pool, store = _tiers(tmp_path)
    tiers = WorkerKVTiers(pool, store, None)
    first = KVTransfers(loads=[(100, 4, digest(100)), (101, 5, digest(101))])
    second = KVTransfers(loads=[(102, 6, digest(102)), (777, 7, digest(777))])  # 777: never written
    reported = [tiers.before_forward(first), tiers.before_forward(second)]
    assert tiers.busy or reported[1] is not None
    for _ in range(2000):  # idle steps (no sequences, no copies) until all four are in
        if sum(len(r) for r in reported if r is not None) == 4:
            break
        reported.append(tiers.before_forward(KVTransfers(), idle=True))
    results = [ok for r in reported if r is not None for ok in r]
    assert results == [True, True, True, False] and not tiers.busy
    for slot, block in ((4, 0), (5, 1), (6, 2)):
        assert torch.equal(pool.slot(slot), pool.slot(block))
    tiers.close()
