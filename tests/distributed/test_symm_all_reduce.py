"""The custom all-reduce's CPU-testable parts (its kernel needs two GPUs: tests/gpu/test_custom_all_reduce.py):
the buffer's size; the engine argument turning it off; the CPU path untouched (gloo, no custom path, whatever
the size asked); the process-group registration symmetric memory looks groups up by, built over a bare backend
as ParallelContext builds it (gloo here, NCCL on CUDA); the ranks' agreement (a failure on any one rank, at
set-up or in the check, turns it off on every rank, with no collective left waiting); and its lifecycle
(close and abort release the name once; abort drains and never frees)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import HashStore, ProcessGroupGloo, _resolve_process_group

from asyncllm.config import EngineConfig
from asyncllm.distributed.parallel_state import ParallelContext
from asyncllm.distributed.symm_all_reduce import SymmMemAllReduce, buffer_bytes, register_group, unregister_group
from asyncllm.executor.multiproc import custom_all_reduce_bytes


def test_buffer_holds_one_decode_step() -> None:
    assert buffer_bytes(256, 4096, torch.bfloat16) == 2 * 1024 * 1024  # Qwen3-8B, 256 sequences
    assert buffer_bytes(256, 4096, torch.float32) == 4 * 1024 * 1024
    assert buffer_bytes(1, 3, torch.bfloat16) == 16  # rounded up to the kernel's 16-byte vectors
    assert buffer_bytes(256, 4096, torch.float16) == 0  # the kernel does not sum float16: NCCL only


def test_engine_argument_and_device_choose_the_size() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on = EngineConfig.from_kwargs("m", max_num_seqs=8)
    off = EngineConfig.from_kwargs("m", max_num_seqs=8, tp_custom_all_reduce=False)
    assert on.parallel_config.tp_custom_all_reduce is True
    assert custom_all_reduce_bytes(on, 64, torch.bfloat16, cuda) == 8 * 64 * 2
    assert custom_all_reduce_bytes(off, 64, torch.bfloat16, cuda) == 0
    assert custom_all_reduce_bytes(on, 64, torch.bfloat16, cpu) == 0


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


class _FakeCustom:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("opens", "checks", "kept"),
    [
        ((True, True), (True, True), True),
        ((True, False), (True, True), False),  # rank 1's set-up raised
        ((False, True), (True, True), False),
        ((True, True), (True, False), False),  # rank 1's sums differ
        ((True, True), (None, True), False),  # rank 0's check raised
    ],
)
def test_every_rank_keeps_it_or_none_does(
    opens: tuple[bool, bool],
    checks: tuple[bool | None, bool | None],
    kept: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Any rank failing at set-up or in its check turns the custom path off on all ranks (one warning each),
    and the ranks that had opened it close it; every collective of the protocol completes on every rank."""
    fakes: dict[int, _FakeCustom] = {}

    def fake_open(cls: type, backend: Any, store: Any, rank: int, *args: Any) -> _FakeCustom:
        if not opens[rank]:
            raise RuntimeError(f"injected: rank {rank} cannot map its peers")
        fakes[rank] = _FakeCustom(rank)
        return fakes[rank]

    def fake_check(self: ParallelContext, custom: _FakeCustom) -> bool:
        verdict = checks[self.rank]
        if verdict is None:
            raise RuntimeError("injected: the check's kernel failed")
        return verdict

    monkeypatch.setattr(SymmMemAllReduce, "open", classmethod(fake_open))
    monkeypatch.setattr(ParallelContext, "_agrees_with_backend", fake_check)
    store = HashStore()
    contexts = _on_ranks(lambda r: ParallelContext(store, r, 2, torch.device("cpu")))
    got = _on_ranks(lambda r: contexts[r]._open_custom_all_reduce(1024))
    if kept:
        assert got == [fakes[0], fakes[1]] and not any(f.closed for f in fakes.values())
    else:
        assert got == [None, None]
        assert all(f.closed for f in fakes.values())
        assert caplog.text.count("custom all-reduce off") == 2
    for context in contexts:
        context.close()


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
