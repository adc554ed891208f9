"""The custom all-reduce's CPU-testable parts (its kernel needs two GPUs: tests/gpu/test_custom_all_reduce.py):
the buffer's size; the tuning variable turning it off (ASYNCLLM_TP_CUSTOM_ALL_REDUCE); the CPU path untouched
(gloo, no custom path, whatever the size asked); the process-group registration symmetric memory looks groups up
by, built over a bare backend as ParallelContext builds it (gloo here, NCCL on CUDA); the ranks' agreement (a
failure on any one rank, at set-up or in the check, turns it off on every rank, with no collective left
waiting); and its lifecycle (close and abort release the name once; abort drains and never frees)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import HashStore, ProcessGroupGloo, _resolve_process_group

from asyncllm.config import EngineConfig
from asyncllm.distributed.agree import choose_together
from asyncllm.distributed.parallel_state import ParallelContext
from asyncllm.distributed.symm_all_reduce import SymmMemAllReduce, buffer_bytes, register_group, unregister_group
from asyncllm.executor.multiproc import custom_all_reduce_bytes


def test_buffer_holds_one_decode_step() -> None:
    assert buffer_bytes(256, 4096, torch.bfloat16) == 2 * 1024 * 1024  # Qwen3-8B, 256 sequences
    assert buffer_bytes(256, 4096, torch.float32) == 4 * 1024 * 1024
    assert buffer_bytes(1, 3, torch.bfloat16) == 16  # rounded up to the kernel's 16-byte vectors
    assert buffer_bytes(256, 4096, torch.float16) == 0  # the kernel does not sum float16: NCCL only


def test_tuning_variable_and_device_choose_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    two = EngineConfig.from_kwargs("m", max_num_seqs=8, tensor_parallel_size=2)
    four = EngineConfig.from_kwargs("m", max_num_seqs=8, tensor_parallel_size=4)
    monkeypatch.delenv("ASYNCLLM_TP_CUSTOM_ALL_REDUCE", raising=False)  # on by default
    assert custom_all_reduce_bytes(two, 64, torch.bfloat16, cuda) == 8 * 64 * 2
    assert custom_all_reduce_bytes(two, 64, torch.bfloat16, cpu) == 0
    assert custom_all_reduce_bytes(two, 64, torch.float16, cuda) == 0  # the kernel does not sum float16
    assert custom_all_reduce_bytes(four, 64, torch.bfloat16, cuda) == 0  # checked bit for bit at two ranks only
    monkeypatch.setenv("ASYNCLLM_TP_CUSTOM_ALL_REDUCE", "0")
    assert custom_all_reduce_bytes(two, 64, torch.bfloat16, cuda) == 0


def test_cpu_group_stays_on_gloo() -> None:
    """A size asked on CPU changes nothing: gloo does every collective, as before."""
    store = HashStore()
    contexts: list[ParallelContext | None] = [None, None]

    def join(rank: int) -> None:
        contexts[rank] = ParallelContext(store, rank, 2, torch.device("cpu"), custom_all_reduce_bytes=1 << 20)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    sums: list[torch.Tensor | None] = [None, None]

    def reduce(rank: int) -> None:
        context = contexts[rank]
        assert context is not None
        sums[rank] = context.all_reduce(torch.full((4, 8), float(rank + 1)))

    threads = [threading.Thread(target=reduce, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for context, total in zip(contexts, sums):
        assert context is not None and total is not None
        assert context.backend_name == "gloo" and not context.custom_all_reduce
        assert torch.equal(total, torch.full((4, 8), 3.0))
        context.close()


def test_registered_group_resolves_by_name_until_unregistered() -> None:
    """What symmetric memory reads from the registry (rank, size, store) is the group's; two engines' names
    never collide; unregistering frees the name."""
    stores = [HashStore(), HashStore()]
    backend = ProcessGroupGloo(stores[0], 0, 1, timedelta(seconds=10))
    group = register_group("asyncllm-tp-test-a", backend, stores[0], 0, 1, "cpu")
    # The name lives on the backend: each engine wraps its own.
    other_backend = ProcessGroupGloo(stores[1], 0, 1, timedelta(seconds=10))
    other = register_group("asyncllm-tp-test-b", other_backend, stores[1], 0, 1, "cpu")
    try:
        found = _resolve_process_group("asyncllm-tp-test-a")  # type: ignore[arg-type]
        assert (found.rank(), found.size(), found.group_name) == (0, 1, "asyncllm-tp-test-a")
        assert found._get_backend(torch.device("cpu")) is not None
        assert _resolve_process_group("asyncllm-tp-test-b").group_name == "asyncllm-tp-test-b"  # type: ignore[arg-type]
        with pytest.raises(RuntimeError):
            register_group("asyncllm-tp-test-a", backend, stores[0], 0, 1, "cpu")
    finally:
        unregister_group("asyncllm-tp-test-a")
        unregister_group("asyncllm-tp-test-b")
    with pytest.raises(RuntimeError, match="Could not resolve"):
        _resolve_process_group("asyncllm-tp-test-a")  # type: ignore[arg-type]
    del group, other


def _on_ranks(fn: Callable[[int], Any], world: int = 2) -> list[Any]:
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank is still waiting in a collective"
    return results


class _Path:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.closed = False


def _vote(world: int) -> Callable[[bool], bool]:
    """`all_agree` for ranks played by threads: true only if every rank said true (a barrier per vote)."""
    votes: list[list[bool]] = []
    barrier = threading.Barrier(world, timeout=10)
    lock = threading.Lock()

    def all_agree(ok: bool) -> bool:
        with lock:
            if not votes or len(votes[-1]) == world:
                votes.append([])
            round_votes = votes[-1]
            round_votes.append(ok)
        barrier.wait()
        result = all(round_votes)
        barrier.wait()  # nobody starts the next round before everyone read this one
        return result

    return all_agree


@pytest.mark.parametrize(
    ("opens", "checks", "kept"),
    [
        ((True, True), (True, True), True),
        ((True, False), (True, True), False),  # rank 1's set-up raised
        ((False, True), (True, True), False),
        ((True, True), (True, False), False),  # rank 1's results differ
    ],
)
def test_every_rank_keeps_the_path_or_none_does(
    opens: tuple[bool, bool], checks: tuple[bool, bool], kept: bool
) -> None:
    """Any rank failing at set-up or in its check turns the path off on all ranks, and the ranks that had
    opened it close it; every vote completes on every rank."""
    paths: dict[int, _Path] = {}
    all_agree = _vote(2)

    def on_rank(rank: int) -> tuple[_Path | None, str]:
        def open_path() -> _Path:
            if not opens[rank]:
                raise RuntimeError(f"injected: rank {rank} cannot map its peers")
            paths[rank] = _Path(rank)
            return paths[rank]

        def close(path: _Path) -> None:
            path.closed = True

        return choose_together(open_path, lambda path: checks[rank], all_agree, close)

    got = _on_ranks(on_rank)
    if kept:
        assert got == [(paths[0], ""), (paths[1], "")] and not any(p.closed for p in paths.values())
    else:
        assert [path for path, _ in got] == [None, None] and all(p.closed for p in paths.values())
        assert all(why for _, why in got)
        if not all(opens):
            assert any("set-up failed" in why and "cannot map" in why for _, why in got)


def test_a_check_that_raises_is_not_voted_on() -> None:
    """Its peers may wait inside one of the check's collectives: the error propagates (start-up fails naming
    it) instead of a vote that would never be matched."""

    def check(path: _Path) -> bool:
        raise RuntimeError("injected: the check's kernel failed")

    with pytest.raises(RuntimeError, match="check's kernel failed"):
        choose_together(lambda: _Path(0), check, lambda ok: ok, lambda path: None)


class _FakeDrain:
    def __init__(self) -> None:
        self.started = 0

    def start(self) -> None:
        self.started += 1


def _registered(name: str) -> bool:
    try:
        _resolve_process_group(name)  # type: ignore[arg-type]
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("end", ["close", "abort"])
def test_close_and_abort_release_the_name_once(end: str) -> None:
    """close frees the buffer; abort starts the drain and keeps the buffer for good (freeing it would wait on
    the device). Either releases the group name, once; the other then does nothing."""
    name = f"asyncllm-tp-test-{end}"
    store = HashStore()
    group = register_group(name, ProcessGroupGloo(store, 0, 1, timedelta(seconds=10)), store, 0, 1, "cpu")
    drain = _FakeDrain()
    buffer = torch.empty(64, dtype=torch.uint8)
    custom = SymmMemAllReduce(name, buffer, [group], drain)  # type: ignore[arg-type]
    assert custom.capacity == 64
    assert not custom.accepts(torch.zeros(8, dtype=torch.bfloat16))  # a CPU tensor: never this path
    assert _registered(name)
    getattr(custom, end)()
    assert not _registered(name)
    assert drain.started == (1 if end == "abort" else 0)
    custom.close()
    custom.abort()
    assert drain.started == (1 if end == "abort" else 0)
