"""Any event loop (issue 10): streams, `generate`, `abort` and cancellation work the same from asyncio,
uvloop and trio (anyio's backends), and loops of all three share one engine at once. Each test is a plain
function running one scenario under `anyio.run` with each backend."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import uvloop

from asyncllm import AsyncLLMEngine, SamplingParams
from tests.fixtures.fake_core import FakeBuilt, fake_built, offline_run

BACKENDS = ["asyncio", "uvloop", "trio"]
_UNBOUNDED = SamplingParams()  # up to max_model_len: a missed abort would run for seconds


def _run(backend: str, scenario: Callable[[], Awaitable[Any]]) -> Any:
    if backend == "uvloop":
        return anyio.run(scenario, backend="asyncio", backend_options={"loop_factory": uvloop.new_event_loop})
    return anyio.run(scenario, backend=backend)


def _engine(bpe_tokenizer: Any, **kwargs: Any) -> tuple[AsyncLLMEngine, FakeBuilt]:
    built = fake_built(bpe_tokenizer, **kwargs)
    return AsyncLLMEngine.from_builder(lambda: built), built


async def _drained(engine: AsyncLLMEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        free = stats["num_free_blocks"] == stats["num_total_blocks"]
        if engine.num_live_requests == 0 and free and stats["num_running"] + stats["num_waiting"] == 0:
            return
        assert time.monotonic() < deadline, f"not drained: {stats}"
        await anyio.sleep(0.005)


def _requests(n: int) -> tuple[list[Any], list[SamplingParams]]:
    rng = random.Random()
    words = ["Hello world", "日本語のテキスト", "emoji 😀🎉", "def add(a, b):"]
    prompts: list[Any] = [
        rng.choice(words) if i % 2 else [rng.randrange(1, 384) for _ in range(rng.randrange(1, 20))] for i in range(n)
    ]
    return prompts, [SamplingParams(max_tokens=rng.randrange(1, 30)) for _ in prompts]


async def _generate_all(engine: AsyncLLMEngine, prompts: list[Any], params: list[SamplingParams]) -> list[Any]:
    results: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        chunks = [c async for c in engine.stream(prompts[i], params[i])]
        results[i] = ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks))

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_streams_equal_offline(backend: str, bpe_tokenizer: Any) -> None:
    prompts, params = _requests(40)
    expected = offline_run(fake_built(bpe_tokenizer), prompts, params)
    engine, _ = _engine(bpe_tokenizer)

    async def scenario() -> None:
        if backend == "trio":
            import trio

            assert trio.lowlevel.current_trio_token() is not None
        else:
            assert isinstance(asyncio.get_running_loop(), uvloop.Loop) == (backend == "uvloop")
        async with engine:
            assert await _generate_all(engine, prompts, params) == expected
            out = await engine.generate("Hello world", SamplingParams(max_tokens=5))
            assert len(out.token_ids) == 5 and out.finish_reason == "length"
            await _drained(engine)
        assert not engine.is_running  # aclose ran its join off this loop, whichever it is

    _run(backend, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_scope_aborts_within_one_step(backend: str, bpe_tokenizer: Any) -> None:
    """Cancellation reaches `__anext__` as the backend's own exception (CancelledError, trio.Cancelled):
    the request leaves the batch within one step, and its blocks are free."""
    engine, built = _engine(bpe_tokenizer, step_delay=0.002, max_model_len=4096)

    async def scenario() -> None:
        stream = engine.add_request([1, 2, 3], _UNBOUNDED)
        with anyio.move_on_after(0.05) as scope:
            async for _ in stream:
                pass
        assert scope.cancelled_caught and stream.finished
        steps = built.executor.num_steps
        await _drained(engine, timeout=2)
        assert built.executor.num_steps - steps <= 1

        async def reader(task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
            s = engine.add_request([4, 5, 6], _UNBOUNDED)
            task_status.started()
            async for _ in s:
                pass

        async with anyio.create_task_group() as tg:  # a task cancelled from outside, in a group
            await tg.start(reader)
            await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        await _drained(engine, timeout=2)

    try:
        _run(backend, scenario)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_break_and_drop(backend: str, bpe_tokenizer: Any) -> None:
    """`engine.abort` from another task ends the stream with "abort"; `break` and dropping the stream abort
    through garbage collection, where trio has no task to watch."""
    engine, _ = _engine(bpe_tokenizer, step_delay=0.002, max_model_len=4096)

    async def scenario() -> None:
        stream = engine.add_request([7, 8], _UNBOUNDED, request_id="victim")
        reasons: list[Any] = []

        async def read() -> None:
            reasons.extend([c.finish_reason async for c in stream])

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.02)
            await engine.abort("victim")
        assert reasons[-1] == "abort" and set(reasons[:-1]) <= {None}
        async for _ in engine.stream([9, 10], _UNBOUNDED):
            break
        holder: list[Any] = [engine.add_request([11, 12], _UNBOUNDED)]
        holder.append(holder)  # a cycle: only the collector frees it
        del holder
        gc.collect()
        await _drained(engine, timeout=2)

    try:
        _run(backend, scenario)
    finally:
        engine.shutdown()


def test_three_loop_libraries_share_one_engine(bpe_tokenizer: Any) -> None:
    """A trio loop, an asyncio loop and a uvloop loop, each in its own thread, stream from one engine at
    once; every result equals the offline core's."""
    prompts, params = _requests(90)
    expected = offline_run(fake_built(bpe_tokenizer), prompts, params)
    engine, _ = _engine(bpe_tokenizer, step_delay=0.001)
    results: dict[str, Any] = {}

    def in_thread(backend: str, part: slice) -> threading.Thread:
        def target() -> None:
            results[backend] = _run(backend, lambda: _generate_all(engine, prompts[part], params[part]))

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    try:
        threads = [in_thread(b, slice(30 * i, 30 * (i + 1))) for i, b in enumerate(BACKENDS)]
        for thread in threads:
            thread.join(30)
        assert results["asyncio"] + results["uvloop"] + results["trio"] == expected
        assert engine.num_event_loops == 0
    finally:
        engine.shutdown()
