"""`SequenceAlignedStore`: ranks whose processes have made different numbers of earlier exchanges still meet
(the bug it exists for: a second TP engine in one process waited for keys its fresh workers never wrote); keys
of other shapes pass through; a wait never outlasts the store's own limit; and C++ code (gloo's rendezvous)
drives it through torch's Python-store trampoline, as symmetric memory's rendezvous does."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from torch._C._distributed_c10d import HashStore, PrefixStore, ProcessGroupGloo, Store

from asyncllm.distributed.aligned_store import SequenceAlignedStore

LONG = timedelta(seconds=30)


def _exchange(store: Store, kind: str, number: int, rank: int, world: int, value: bytes) -> list[bytes]:
    """One all-gather the way torch's StoreExchange makes it: set your key, wait for and read every peer's."""
    keys = [f"{kind}/{number}/{r}" for r in range(world)]
    store.set(keys[rank], value)  # type: ignore[arg-type]  # the stubs say str; C++ passes bytes
    store.wait(keys)
    return [store.get(k) for k in keys]


def _on_threads(fns: list[Callable[[], object]]) -> list[object]:
    results: list[object] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_ranks_with_different_process_counters_meet() -> None:
    """Rank 0's process made 3 exchanges for an earlier engine (its counter is at 3), rank 1's none: under the
    aligned stores their first, second and third exchanges meet, each with its own values."""
    shared = HashStore()
    stores = [SequenceAlignedStore(PrefixStore("engine-2/", shared), LONG) for _ in range(2)]
    start = [3, 0]

    def rank(r: int) -> Callable[[], object]:
        return lambda: [
            _exchange(stores[r], "CUDASymmetricMemory", start[r] + i, r, 2, f"{i}:{r}".encode()) for i in range(3)
        ]

    got = _on_threads([rank(0), rank(1)])
    want = [[f"{i}:0".encode(), f"{i}:1".encode()] for i in range(3)]
    assert got == [want, want]
    assert stores[0].aligned("CUDASymmetricMemory/5/1") == "CUDASymmetricMemory/2/1"
    assert stores[1].aligned("CUDASymmetricMemory/2/1") == "CUDASymmetricMemory/2/1"


def test_each_kind_counts_from_its_own_first_number_and_other_keys_pass_through() -> None:
    store = SequenceAlignedStore(HashStore(), LONG)
    assert store.aligned("A/7/0") == "A/0/0"
    assert store.aligned("B/2/1") == "B/0/1"
    assert store.aligned("A/9/1") == "A/2/1"
    assert store.aligned("pre/A/4/1") == "pre/A/0/1"  # a prefix in front: its own kind
    for key in ("0/1", "7/3/1", "/3/1", "A/x/1", "A/1/x", "plain"):
        assert store.aligned(key) == key


@pytest.mark.slow
def test_a_wait_fails_within_the_stores_limit() -> None:
    """Set-up gives up on a peer that never writes (NCCL is kept) instead of waiting for the caller's timeout."""
    store = SequenceAlignedStore(HashStore(), timedelta(seconds=0.5))
    start = time.monotonic()
    with pytest.raises(Exception, match=r"(?i)timeout|timed out|wait"):
        store.wait(["never/0/1"], timedelta(seconds=60))
    assert time.monotonic() - start < 5


def test_cpp_drives_it_through_the_trampoline() -> None:
    """gloo's C++ rendezvous calls set/wait/get on the Python subclass from its own code; the group it builds
    sums correctly."""
    shared = HashStore()
    stores = [SequenceAlignedStore(PrefixStore("g/", shared), LONG) for _ in range(2)]
    groups: list[ProcessGroupGloo | None] = [None, None]

    def build(r: int) -> Callable[[], object]:
        def run() -> None:
            groups[r] = ProcessGroupGloo(stores[r], r, 2, timedelta(seconds=30))

        return run

    _on_threads([build(0), build(1)])

    def reduce(r: int) -> Callable[[], object]:
        def run() -> torch.Tensor:
            t = torch.full((3,), float(r + 1))
            group = groups[r]
            assert group is not None
            group.allreduce([t]).wait()
            return t

        return run

    sums = _on_threads([reduce(0), reduce(1)])
    assert all(torch.equal(s, torch.full((3,), 3.0)) for s in sums)  # type: ignore[arg-type]
