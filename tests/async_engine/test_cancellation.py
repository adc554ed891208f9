"""Every way of leaving a stream aborts its request: task cancellation, `break`, `aclose()`, garbage
collection and `engine.abort()`; aborts are idempotent and applied before a step's outputs, and afterwards
every KV block is free."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from collections.abc import Sequence

import pytest

from asyncllm import SamplingParams, StreamOutput
from asyncllm.async_engine.stream import RequestStream
from tests.async_engine.conftest import EngineFactory, wait_drained
from tests.fixtures.fake_executor import hash_next_token, reference_tokens

_MODES = ("cancel", "break", "aclose", "abort", "drop", "finish")
# Requests that would run ~8 s if not aborted, checked with a 2 s wait: a missed abort cannot pass unseen.
_LONG = dict(step_delay=0.002, max_model_len=4096)
_UNBOUNDED = SamplingParams()  # max_tokens=None: up to max_model_len


async def _consume(stream: RequestStream, mode: str, n_chunks: int, log: list[StreamOutput]) -> None:
    if mode == "drop":
        return  # never iterated: the stream's last reference goes with this frame
    async for chunk in stream:
        log.append(chunk)
        if len(log) >= n_chunks:
            if mode == "break":
                break
            if mode == "aclose":
                await stream.aclose()
                return
        await asyncio.sleep(0)


@pytest.mark.core_process
async def test_cancellation_storm_frees_everything(make_engine: EngineFactory) -> None:
    """500 streams ended at random points by a random mix of every way out (and a few finishing)."""
    rng = random.Random()
    # Only "finish" streams are short: a leaked request would run for thousands of steps, far past the wait.
    engine, _ = make_engine(step_delay=0.0005, num_kv_blocks=512, max_num_seqs=64, max_model_len=2048)
    tasks: list[asyncio.Task[None]] = []
    plans: list[tuple[str, RequestStream | None, list[StreamOutput]]] = []
    for _ in range(500):
        mode = rng.choice(_MODES)
        prompt = [rng.randrange(1, 384) for _ in range(rng.randrange(1, 24))]
        max_tokens = rng.randrange(1, 40) if mode == "finish" else None
        stream: RequestStream | None = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
        log: list[StreamOutput] = []
        task = asyncio.create_task(_consume(stream, mode, rng.randrange(1, 6), log))  # type: ignore[arg-type]
        request_id = stream.request_id  # type: ignore[union-attr]
        if mode in ("drop", "break", "cancel"):
            stream = None  # only the consumer holds it (a task cancelled before it starts drops it unread)
        tasks.append(task)
        plans.append((mode, stream, log))
        if mode == "cancel":
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.05), task.cancel)
        elif mode == "abort":
            asyncio.get_running_loop().call_later(
                rng.uniform(0, 0.05), lambda rid=request_id: asyncio.ensure_future(engine.abort(rid))
            )
        if rng.random() < 0.1:
            await asyncio.sleep(0.001)
    del stream
    _, pending = await asyncio.wait(tasks, timeout=30)
    assert not pending
    for (mode, _, log), task in zip(plans, tasks):
        if mode == "cancel":
            assert task.cancelled() or (log and log[-1].finish_reason is not None)
        else:
            assert task.exception() is None
        if mode in ("abort", "finish") and not task.cancelled():
            assert log[-1].finish_reason == ("abort" if mode == "abort" else "length")
    # A task cancelled before it ever ran keeps its coroutine's arguments (the stream) for as long as the
    # task object lives, and the stream cannot know that task: only dropping the task lets GC abort it.
    del tasks, plans, task
    await asyncio.sleep(0.06)  # the last call_later aborts have fired
    stats = await wait_drained(engine, timeout=2)
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 512
    assert engine.is_running  # a double free would have tripped the block manager and killed the engine
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


async def _blocking_step(make_engine: EngineFactory, max_tokens: int, block_at: int):  # type: ignore[no-untyped-def]
    """An engine whose forward pass stops at output token `block_at` until released: (engine, stream,
    reached, release, expected tokens)."""
    prompt = [11, 22, 33, 44, 55]
    base = hash_next_token(384, frozenset({0}))
    reached, release = threading.Event(), threading.Event()

    def next_token(seq: Sequence[int]) -> int:
        if len(seq) == len(prompt) + block_at - 1 and not reached.is_set():
            reached.set()
            assert release.wait(5)
        return base(seq)

    engine, _ = make_engine(next_token=next_token)
    stream = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    expected = reference_tokens(base, prompt, max_tokens, frozenset({0}))
    return engine, stream, reached, release, expected


@pytest.mark.parametrize("max_tokens", [20, 8])  # 8: the aborted step would also have finished it
async def test_abort_during_forward_gets_no_token_from_that_step(make_engine: EngineFactory, max_tokens: int) -> None:
    engine, stream, reached, release, expected = await _blocking_step(make_engine, max_tokens, block_at=8)
    reader = asyncio.create_task(_collect(stream))
    assert await asyncio.to_thread(reached.wait, 5)
    await engine.abort(stream.request_id)  # arrives while the forward pass runs
    release.set()
    chunks = await asyncio.wait_for(reader, 5)
    tokens = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].finish_reason == "abort" and chunks[-1].metrics is not None
    assert tokens == expected[:7]
    await wait_drained(engine)
    assert engine.is_running


async def _collect(stream: RequestStream) -> list[StreamOutput]:
    return [chunk async for chunk in stream]


async def test_abort_is_idempotent_and_unknown_ids_are_no_ops(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(**_LONG)
    await engine.abort("never-existed")
    stream = engine.add_request([1, 2, 3], _UNBOUNDED)
    for _ in range(3):
        await engine.abort(stream.request_id)
    stream.close()
    await stream.aclose()
    chunks = [c async for c in stream]
    assert chunks == []  # closed by the caller: nothing more is read
    await wait_drained(engine, timeout=2)
    done = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
    await engine.abort(done.request_id)  # finished: a no-op
    assert engine.is_running


@pytest.mark.core_process
async def test_abort_before_the_step_thread_saw_the_request(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(**{**_LONG, "step_delay": 0.005})
    busy = engine.add_request([9] * 8, _UNBOUNDED)  # keeps the step thread in steps
    await asyncio.sleep(0.01)
    stream = engine.add_request([1, 2, 3], _UNBOUNDED)
    await engine.abort(stream.request_id)  # queued right behind its own add
    chunks = await asyncio.wait_for(_collect(stream), 5)
    assert chunks[-1].finish_reason == "abort"
    busy.close()
    await wait_drained(engine, timeout=2)


@pytest.mark.core_process
async def test_abort_waiting_request(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(**_LONG, max_num_seqs=1)
    running = engine.add_request([5, 6], _UNBOUNDED)
    waiting = engine.add_request([7, 8], _UNBOUNDED)
    await asyncio.sleep(0.02)
    assert engine.stats()["num_waiting"] == 1
    await engine.abort(waiting.request_id)
    chunks = await asyncio.wait_for(_collect(waiting), 5)
    assert [c.finish_reason for c in chunks] == ["abort"] and chunks[0].token_ids == ()
    running.close()
    await wait_drained(engine, timeout=2)


async def test_cancelling_generate_aborts(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(**_LONG)
    task = asyncio.create_task(engine.generate([1, 2, 3], _UNBOUNDED))
    await asyncio.sleep(0.03)
    assert engine.stats()["num_running"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_drained(engine, timeout=2)


@pytest.mark.core_process
async def test_break_and_garbage_collection_abort(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(**_LONG)
    async for _ in engine.stream([1, 2, 3], _UNBOUNDED):
        break  # the iterator's only reference is dropped here
    await wait_drained(engine, timeout=2)

    class Holder:  # a reference cycle: only the cyclic collector frees it
        pass

    holder = Holder()
    holder.self = holder  # type: ignore[attr-defined]
    holder.stream = engine.add_request([4, 5, 6], _UNBOUNDED)  # type: ignore[attr-defined]
    await asyncio.sleep(0.02)
    assert engine.num_live_requests == 1
    del holder
    gc.collect()
    await wait_drained(engine, timeout=2)


async def test_stream_iterated_from_another_loop_is_refused(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    stream = engine.add_request([1, 2], SamplingParams(max_tokens=3))

    def other_loop() -> None:
        async def read() -> None:
            await stream.__anext__()

        asyncio.run(read())

    with pytest.raises(RuntimeError, match="another event loop"):
        await asyncio.to_thread(other_loop)
    assert len(await _collect(stream)) >= 1


@pytest.mark.core_process
async def test_reader_cancelled_in_its_loop_body_aborts_while_the_task_lives(make_engine: EngineFactory) -> None:
    """Regression: a task cancelled outside `__anext__` (in the body of its `async for`) keeps the stream
    alive through the CancelledError's traceback for as long as someone holds the task; it must abort
    anyway, not only when the task is finally garbage-collected."""
    engine, _ = make_engine(**_LONG)
    in_body = asyncio.Event()

    async def reader() -> None:
        stream = engine.stream([1, 2, 3], _UNBOUNDED)  # a local: the traceback's frame keeps it
        async for _ in stream:
            in_body.set()
            await asyncio.sleep(10)  # cancelled here, not while awaiting the stream

    task = asyncio.create_task(reader())
    await asyncio.wait_for(in_body.wait(), 2)
    task.cancel()
    await asyncio.wait([task])  # unlike `await task`, keeps the task's CancelledError and its traceback
    await wait_drained(engine, timeout=2)
    assert task.cancelled()


async def test_cancellation_swallowed_by_the_reader_still_aborts(make_engine: EngineFactory) -> None:
    """The abort happens inside `__anext__` as CancelledError passes, whatever the task does with it."""
    engine, _ = make_engine(**_LONG)
    stream = engine.add_request([1, 2, 3], _UNBOUNDED)  # held here: garbage collection cannot help
    first = asyncio.Event()

    async def reader() -> str:
        try:
            async for _ in stream:
                first.set()
        except asyncio.CancelledError:
            return "swallowed"
        return "finished"

    task = asyncio.create_task(reader())
    await asyncio.wait_for(first.wait(), 2)
    await asyncio.sleep(0.01)  # the reader now waits inside __anext__
    task.cancel()
    assert await task == "swallowed"
    await wait_drained(engine, timeout=2)
    assert stream.finished


@pytest.mark.slow
async def test_long_lived_reader_does_not_collect_callbacks(make_engine: EngineFactory) -> None:
    """Regression: each stream a task read (then broke out of) left a done-callback on that task, so a
    long-lived reader held memory for every stream it ever read. Measured from outside: what asyncllm's own
    code allocated and still holds after 40 streams and after 240 must not grow with the count."""
    import tracemalloc
    from pathlib import Path

    import asyncllm

    # A small cache: the block manager's free list (bounded by it) is fully cycled before the first reading.
    engine, built = make_engine(**{**_LONG, "max_model_len": 128}, num_kv_blocks=32)
    package = str(Path(asyncllm.__file__).parent)

    async def read(n: int) -> None:
        for _ in range(n):
            async for _ in engine.stream([1, 2, 3], _UNBOUNDED):
                break
            async for _ in engine.stream([4, 5], SamplingParams(max_tokens=2)):
                pass
        await wait_drained(engine, timeout=2)

    def held_by_asyncllm() -> int:
        built.executor.steps.clear()  # the test double records every step; the engine itself must not
        gc.collect()
        stats = (
            tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, package + "/*")]).statistics("filename")
        )
        return sum(s.count for s in stats)

    tracemalloc.start()
    try:
        await read(40)
        after_few = held_by_asyncllm()
        await read(200)
        after_many = held_by_asyncllm()
    finally:
        tracemalloc.stop()
    assert after_many - after_few < 100, f"{after_many - after_few} more blocks held after 200 more streams"
