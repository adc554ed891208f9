"""The engine under pressure (issue 22): `max_waiting_requests` refuses exactly beyond it, at once, from any
thread, and loses nothing it accepted; priorities reach the scheduler through `add_request`; `drain()`
lets streams finish, refuses new ones and aborts what outlives its timeout; `check_health` uses the
engine's own stuck-step bound."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from asyncllm import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineStalledError,
    InvalidRequestError,
    SamplingParams,
)
from asyncllm.errors import AsyncLLMError, InvalidConfigError
from tests.async_engine.conftest import wait_drained
from tests.fixtures.fake_core import FakeBuilt, fake_built, offline_run

ENDLESS = SamplingParams(max_tokens=4000, ignore_eos=True)


def _engine(tokenizer: Any, max_waiting: int | None, **kwargs: Any) -> tuple[AsyncLLMEngine, FakeBuilt]:
    kwargs.setdefault("max_model_len", 4096)
    built = fake_built(tokenizer, **kwargs)
    return AsyncLLMEngine.from_builder(lambda: built, max_waiting_requests=max_waiting), built


async def _started(engine: AsyncLLMEngine, running: int) -> None:
    """Wait until `running` requests run and none waits to start."""
    deadline = time.monotonic() + 5
    while not (engine.stats()["num_queued"] == 0 and engine.stats()["num_running"] == running):
        assert time.monotonic() < deadline, engine.stats()
        await asyncio.sleep(0.002)


async def _tokens(stream: Any) -> tuple[list[int], str | None]:
    chunks = [c async for c in stream]
    return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason


async def test_the_queue_bound_refuses_exactly_beyond_it(bpe_tokenizer: Any) -> None:
    """Regression (issue 22): nothing bounded the waiting queue. With the only seat taken, five requests are
    accepted (text and token ids alike), the sixth raises EngineOverloadedError at once and leaves nothing
    behind; as each waiting one starts, exactly one more fits; every accepted request completes."""
    engine, built = _engine(bpe_tokenizer, 5, max_num_seqs=1, step_delay=0.002)
    try:
        blocker = engine.add_request([1, 2, 3], ENDLESS, request_id="blocker")
        await _started(engine, 1)
        prompts: list[Any] = [[4, 5, 6 + i] for i in range(4)] + ["a text prompt"]
        params = SamplingParams(max_tokens=3)
        accepted = [engine.add_request(p, params) for p in prompts]
        assert engine.stats()["num_queued"] == 5
        t0 = time.perf_counter()
        with pytest.raises(EngineOverloadedError, match=r"5 requests already wait to start \(max_waiting_requests=5\)"):
            engine.add_request([9, 9, 9], params, request_id="refused")
        with pytest.raises(EngineOverloadedError):
            engine.add_request("refused text", params)
        # "At once": a refusal that waited would wait for the seat, which ENDLESS holds for 8 s and more; the
        # bound leaves room for a loaded 2-core machine (0.1 s was tight there).
        assert time.perf_counter() - t0 < 2.0
        stats = engine.stats()
        assert (stats["num_queued"], stats["num_rejected"], engine.num_live_requests) == (5, 2, 6)
        await engine.abort("blocker")
        assert (await _tokens(blocker))[1] == "abort"
        first = await _tokens(accepted[0])  # it started, and so its place is free
        assert first[1] == "length"
        late = engine.add_request([7, 7, 7], params, request_id="refused")  # the id was never taken
        results = [first] + [await _tokens(s) for s in [*accepted[1:], late]]
        want = offline_run(fake_built(bpe_tokenizer), [*prompts, [7, 7, 7]], [params] * 6)
        assert [r[0] for r in results] == [w[0] for w in want]
        stats = await wait_drained(engine)
        assert (stats["num_queued"], stats["num_rejected"]) == (0, 2)
        assert len(built.executor.steps) > 0
    finally:
        engine.shutdown()


async def test_the_bound_is_exact_across_threads_and_loops(bpe_tokenizer: Any) -> None:
    """Eight threads, each with its own event loop, add 30 requests each at the same moment while the seat
    is taken: exactly max_waiting_requests are accepted, every other one is refused at once."""
    engine, _ = _engine(bpe_tokenizer, 17, max_num_seqs=1, step_delay=0.002)
    barrier = threading.Barrier(8)
    outcomes: list[str] = []
    lock = threading.Lock()
    kept: list[Any] = []

    async def add_many(tag: int) -> None:
        barrier.wait()
        for i in range(30):
            try:
                stream = engine.add_request([tag + 1, i + 1], SamplingParams(max_tokens=2))
                kept.append(stream)  # alive until the test ends: dropping a stream would abort it
                result = "accepted"
            except EngineOverloadedError:
                result = "refused"
            with lock:
                outcomes.append(result)

    try:
        blocker = engine.add_request([1, 2, 3], ENDLESS, request_id="blocker")  # read by nobody: it runs on
        await _started(engine, 1)
        threads = [threading.Thread(target=lambda t=t: asyncio.run(add_many(t))) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            await asyncio.to_thread(thread.join, 10)
        assert outcomes.count("accepted") == 17 and outcomes.count("refused") == 240 - 17
        assert engine.stats()["num_rejected"] == 240 - 17 and engine.stats()["num_queued"] == 17
        assert not blocker.finished
    finally:
        engine.shutdown()


@pytest.mark.slow
async def test_admitting_while_the_step_thread_starts_requests_loses_nothing(bpe_tokenizer: Any) -> None:
    """The race between callers adding and the step thread starting: four threads add 60 requests each
    while four seats turn over; the queue never holds more than the bound, refusals are counted, and every
    accepted request completes with the tokens an offline run gives."""
    engine, _ = _engine(bpe_tokenizer, 6, max_num_seqs=4, step_delay=0.0005)
    refused = 0
    lock = threading.Lock()
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, int(engine.stats()["num_queued"]))

    async def add_and_read(tag: int) -> list[tuple[list[int], tuple[list[int], str | None]]]:
        nonlocal refused
        mine = []
        for i in range(60):
            prompt = [tag + 1, i + 1, 7]
            try:
                stream = engine.add_request(prompt, SamplingParams(max_tokens=1 + i % 5))
            except EngineOverloadedError:
                with lock:
                    refused += 1
                await asyncio.sleep(0.001)
                continue
            mine.append((prompt, stream))
        return [(prompt, await _tokens(stream)) for prompt, stream in mine]

    results: list[Any] = []

    def run(tag: int) -> None:
        out = asyncio.run(add_and_read(tag))
        with lock:
            results.extend(out)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            await asyncio.to_thread(thread.join, 20)
        done.set()
        watcher.join()
        assert len(results) + refused == 240 and refused > 0 and len(results) > 6
        assert peak <= 6 and engine.stats()["num_rejected"] == refused
        prompts = [prompt for prompt, _ in results]
        params = [SamplingParams(max_tokens=1 + (prompt[1] - 1) % 5) for prompt in prompts]
        want = offline_run(fake_built(bpe_tokenizer, max_model_len=4096), prompts, params)
        assert [tokens for _, (tokens, _) in results] == [w[0] for w in want]
        assert all(reason == "length" for _, (_, reason) in results)
        await wait_drained(engine)
    finally:
        done.set()
        engine.shutdown()


async def test_priority_orders_admission_and_preempts(bpe_tokenizer: Any) -> None:
    """One seat, held by a low-priority request: better-ranked ones preempt it and run in rank order
    (FIFO among equals); it resumes last; a bad priority is refused at once, naming it."""
    go = threading.Event()
    go.set()
    tokenized = threading.Event()  # "d"'s text has been tokenized: it and "e" behind it go to the core next
    step = fake_built(bpe_tokenizer).executor.next_token

    def next_token(seq: Any) -> int:
        assert go.wait(10)
        return step(seq)

    built = fake_built(bpe_tokenizer, max_model_len=4096, max_num_seqs=1, next_token=next_token, step_delay=0.001)
    assert built.encode is not None
    encode = built.encode

    def encode_and_say(text: str) -> list[int]:
        ids = encode(text)
        if text == "some text":
            tokenized.set()
        return ids

    built.encode = encode_and_say
    engine = AsyncLLMEngine.from_builder(lambda: built)
    try:
        low = engine.add_request([1, 2, 3], ENDLESS, request_id="low", priority=5)
        await _started(engine, 1)
        go.clear()  # the step thread stops in its next step: everything below reaches the core at once
        params = SamplingParams(max_tokens=3)
        others = [
            engine.add_request([4, 5, 6], params, request_id="b", priority=1),
            engine.add_request([4, 5, 7], params, request_id="c", priority=0),
            engine.add_request("some text", params, request_id="d", priority=1),
            engine.add_request([4, 5, 9], params, request_id="e", priority=-1),
        ]
        # "d" is tokenized ("e" waits behind it: requests reach the core in order). Waited for, not slept on:
        # tokenizing past a fixed sleep on a loaded machine let "b" and "c" start first. The sleep after covers
        # the tokenizer thread handing "d" and "e" on (microseconds).
        assert await asyncio.to_thread(tokenized.wait, 10)
        await asyncio.sleep(0.1)
        go.set()
        for stream in others:
            assert (await _tokens(stream))[1] == "length"
        await _started(engine, 1)  # "low" resumed
        await engine.abort("low")
        assert (await _tokens(low))[1] == "abort"
        started = [new.request_id for step in built.executor.steps for new in step.new_requests]
        assert started == ["low", "e", "c", "b", "d"]
        assert engine.stats()["num_preemptions"] >= 1
        for bad in ("high", 1.0, True, None):
            with pytest.raises(InvalidRequestError, match=r"priority=.* is invalid: give an integer"):
                engine.add_request([1], params, priority=bad)  # type: ignore[arg-type]
        out = await engine.generate([4, 5, 6], params, priority=2)
        assert out.finish_reason == "length"
        await wait_drained(engine)
    finally:
        engine.shutdown()


async def test_drain_finishes_streams_refuses_new_ones_then_aborts_the_rest(bpe_tokenizer: Any) -> None:
    engine, _ = _engine(bpe_tokenizer, None, step_delay=0.002)
    try:
        short = [engine.add_request([i + 1, 2, 3], SamplingParams(max_tokens=20)) for i in range(4)]
        draining = asyncio.create_task(engine.drain(timeout=10))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineDrainingError, match="draining"):
            engine.add_request([1, 2], SamplingParams(max_tokens=2))
        with pytest.raises(EngineDrainingError):
            await engine.check_health()
        assert engine.is_draining and not engine.is_running
        assert [(await _tokens(s))[1] for s in short] == ["length"] * 4  # they finish whole
        assert await asyncio.wait_for(draining, 5) == 0
        stats = await wait_drained(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        engine.shutdown()
    engine, _ = _engine(bpe_tokenizer, None, step_delay=0.002)
    try:
        endless = [engine.add_request([i + 1, 5], ENDLESS) for i in range(3)]
        await _started(engine, 3)
        t0 = time.monotonic()
        assert await engine.drain(timeout=0.2) == 3  # they outlive it: aborted, each ending its stream
        assert 0.2 <= time.monotonic() - t0 < 2
        assert [(await _tokens(s))[1] for s in endless] == ["abort"] * 3
        stats = await wait_drained(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert await engine.drain(timeout=0) == 0  # idempotent
        await engine.aclose()
        with pytest.raises(EngineDeadError, match="shut down"):
            engine.add_request([1], SamplingParams(max_tokens=1))
    finally:
        engine.shutdown()


async def test_check_health_uses_the_engines_stuck_step_bound(bpe_tokenizer: Any) -> None:
    release = threading.Event()

    def next_token(seq: Any) -> int:
        assert release.wait(10)
        return 1

    built = fake_built(bpe_tokenizer, next_token=next_token)
    engine = AsyncLLMEngine.from_builder(lambda: built, max_step_seconds=0.2)
    try:
        stream = engine.add_request([1, 2], SamplingParams(max_tokens=1))
        await asyncio.sleep(0.3)
        # Polled past the sleep: on a loaded machine the step may start late, and 0.3 s after the add it has not
        # yet run for the bound's 0.2 s.
        deadline = time.monotonic() + 10
        while True:
            try:
                await engine.check_health()
            except EngineStalledError as stalled:
                assert "(bound 0.2 s)" in str(stalled), stalled
                break
            assert time.monotonic() < deadline, "the stuck step never made the engine unhealthy"
            await asyncio.sleep(0.05)
        await engine.check_health(max_step_seconds=30)  # a bound of the caller's own still wins
        release.set()
        assert (await _tokens(stream))[1] == "length"
        await engine.check_health()
    finally:
        release.set()
        engine.shutdown()
    for bad in (0, -1.0, "20"):
        with pytest.raises(InvalidConfigError, match="max_step_seconds"):
            AsyncLLMEngine.from_builder(lambda: built, max_step_seconds=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="max_waiting_requests"):
        AsyncLLMEngine.from_builder(lambda: built, max_waiting_requests=0)
    assert issubclass(EngineOverloadedError, AsyncLLMError) and issubclass(EngineDrainingError, EngineDeadError)
