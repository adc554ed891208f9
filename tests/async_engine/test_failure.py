"""Engine death and shutdown: live streams raise `EngineDeadError` (cause chained) within a second, later
requests raise it at once, the step thread is gone and the core released its device. Nothing hangs."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from asyncllm import AsyncLLMEngine, EngineDeadError, SamplingParams
from asyncllm.async_engine.stream import RequestStream
from tests.async_engine.conftest import EngineFactory
from tests.fixtures.fake_core import fake_built
from tests.fixtures.fake_executor import InjectedFailure


async def _drain(stream: RequestStream) -> int:
    n = 0
    async for chunk in stream:
        n += len(chunk.token_ids)
    return n


async def _join(engine: AsyncLLMEngine, timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.step_thread_alive:
        assert time.monotonic() < deadline, "step thread still alive"
        await asyncio.sleep(0.005)


async def test_fault_in_forward_kills_engine_and_every_stream(make_engine: EngineFactory) -> None:
    engine, built = make_engine(step_delay=0.002, max_model_len=4096)
    streams = [engine.add_request([i + 1, 5, 9], SamplingParams()) for i in range(20)]
    readers = [asyncio.create_task(_drain(s)) for s in streams]
    await asyncio.sleep(0.03)
    assert all(not r.done() for r in readers)
    built.executor.fail_after_steps = built.executor.num_steps  # the next forward pass raises
    t0 = time.monotonic()
    done, pending = await asyncio.wait(readers, timeout=1.0)
    assert not pending and time.monotonic() - t0 < 1.0
    for reader in done:
        error = reader.exception()
        assert isinstance(error, EngineDeadError) and isinstance(error.__cause__, InjectedFailure)
    with pytest.raises(EngineDeadError) as info:
        engine.add_request([1, 2, 3])
    assert isinstance(info.value.__cause__, InjectedFailure)
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    assert not engine.is_running and isinstance(engine.dead_error, EngineDeadError)
    await _join(engine)
    assert built.executor.is_shut_down  # the core released its device on the way out
    engine.shutdown()  # still fine, and idempotent


# One loop: the bounded wait (spent in full on purpose, set short here) is the step thread's join, which no
# loop touches.
@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_shutdown_of_a_dead_engine_does_not_wait_on_a_stuck_release(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead tensor-parallel peer can leave a kernel spinning on the GPU, and the step thread's release of the
    device (a device-wide sync) stuck behind it for good: the engine is dead already, so shutdown returns after
    a short bound (`ASYNCLLM_DEAD_ENGINE_JOIN_S`, 6 s by default) instead of the minute a live step in flight
    is given."""
    bound = 0.5
    monkeypatch.setenv("ASYNCLLM_DEAD_ENGINE_JOIN_S", str(bound))
    engine, built = make_engine(step_delay=0.002, max_model_len=4096)
    stuck = threading.Event()
    released = threading.Event()

    def blocking_shutdown() -> None:
        stuck.set()
        released.wait(30)

    built.executor.shutdown = blocking_shutdown  # type: ignore[method-assign]
    stream = engine.add_request([1, 5, 9], SamplingParams())
    reader = asyncio.create_task(_drain(stream))
    await asyncio.sleep(0.02)
    built.executor.fail_after_steps = built.executor.num_steps
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(reader, 1.0)
    assert await asyncio.to_thread(stuck.wait, 1.0)
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(engine.aclose(), 10)
        assert bound * 0.9 < time.monotonic() - t0 < bound + 4.0  # the bound, not the minute
        assert engine.step_thread_alive  # left behind, still releasing
    finally:
        released.set()
    await _join(engine)


async def test_executor_failure_between_steps_kills_an_idle_engine(make_engine: EngineFactory) -> None:
    """An executor reporting a failure while the engine idles (a TP worker died with no step in flight): the
    engine dies at once, so health checks say so before any request is sent."""
    engine, built = make_engine()
    await engine.generate([1, 5, 9], SamplingParams(max_tokens=3))
    await engine.check_health()
    built.executor.failure_callback(InjectedFailure("worker 1 died"))
    await _join(engine)
    with pytest.raises(EngineDeadError) as info:
        await engine.check_health()
    assert isinstance(info.value.__cause__, InjectedFailure)
    with pytest.raises(EngineDeadError):
        engine.add_request([1, 2, 3])


@pytest.mark.core_process
async def test_shutdown_ends_pending_streams(make_engine: EngineFactory) -> None:
    engine, built = make_engine(step_delay=0.002, max_model_len=4096)
    streams = [engine.add_request([i + 1, 7], SamplingParams()) for i in range(10)]
    readers = [asyncio.create_task(_drain(s)) for s in streams]
    await asyncio.sleep(0.02)
    await asyncio.wait_for(engine.aclose(), 2)
    done, pending = await asyncio.wait(readers, timeout=1.0)
    assert not pending
    for reader in done:
        error = reader.exception()
        assert isinstance(error, EngineDeadError) and "shut down" in str(error)
    assert not engine.step_thread_alive and built.executor.is_shut_down
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.add_request([1])
    await engine.abort(streams[0].request_id)  # aborting after shutdown is a harmless no-op
    await engine.aclose()


def test_load_error_raises_in_constructor() -> None:
    def build() -> object:
        raise FileNotFoundError("no checkpoint at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        AsyncLLMEngine.from_builder(build)  # type: ignore[arg-type]


def test_public_constructor_validates_before_loading(tmp_path: object) -> None:
    with pytest.raises(TypeError, match="no_such_arg"):
        AsyncLLMEngine("/nowhere", no_such_arg=1)
    with pytest.raises(ValueError, match="block_size"):
        AsyncLLMEngine("/nowhere", block_size=3)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):  # the runner's own error, in the caller
        AsyncLLMEngine(str(tmp_path), device="cpu")


def test_dropped_engine_stops_its_thread(bpe_tokenizer: object) -> None:
    built = fake_built(bpe_tokenizer)
    before = set(threading.enumerate())
    engine = AsyncLLMEngine.from_builder(lambda: built)
    (step_thread,) = set(threading.enumerate()) - before
    del engine
    gc.collect()
    assert not step_thread.is_alive() and built.executor.is_shut_down
