"""Merge-on-put: a lagging consumer gets every token in fewer, larger chunks while others run unaffected,
and the step thread wakes each event loop at most once per step."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from asyncllm import SamplingParams, StreamOutput
from asyncllm.async_engine.stream import RequestStream
from tests.async_engine.conftest import EngineFactory, wait_drained
from tests.fixtures.fake_core import fake_built, offline_run

# The slow reader's pause after each chunk; 60 steps of the fake take ~0.15 s idle, and the fast readers must
# end within the first pause: 1 s leaves room for a loaded 2-core machine and a core process (0.5 s was tight).
_SLOW_S = 1.0


async def _read(stream: RequestStream, delay: float) -> tuple[list[StreamOutput], float]:
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if delay:
            await asyncio.sleep(delay)
    return chunks, time.monotonic()


@pytest.mark.core_process
@pytest.mark.slow
async def test_slow_consumer_gets_everything_in_fewer_chunks(make_engine: EngineFactory, bpe_tokenizer: object) -> None:
    prompts = [[(7 * i + j) % 383 + 1 for j in range(6)] for i in range(9)]
    params = [SamplingParams(max_tokens=60)] * 9
    expected = offline_run(fake_built(bpe_tokenizer), prompts, params)
    engine, _ = make_engine(step_delay=0.002)
    streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    start = time.monotonic()
    results = await asyncio.gather(_read(streams[0], delay=_SLOW_S), *(_read(s, delay=0.0) for s in streams[1:]))
    (slow_chunks, slow_end), fast = results[0], results[1:]
    for (chunks, _), (tokens, text) in zip(results, expected):
        assert [t for c in chunks for t in c.token_ids] == tokens  # nothing dropped, nothing reordered
        assert "".join(c.text for c in chunks) == text
        assert chunks[-1].finish_reason == "length" and chunks[-1].metrics is not None
    assert 2 <= len(slow_chunks) < 60 // 3, "a lagging consumer's output merges into larger chunks"
    fast_end = max(end for _, end in fast)
    # The engine never waited for the slow reader: the fast ones were done before its first pause ended.
    assert fast_end - start < _SLOW_S <= slow_end - start
    await wait_drained(engine)


@pytest.mark.core_process
@pytest.mark.asyncio(loop_factories=["asyncio"])  # counts calls by patching the loop (not possible on uvloop)
async def test_one_wakeup_per_loop_per_step(make_engine: EngineFactory) -> None:
    loop = asyncio.get_running_loop()
    step_thread_calls = 0
    original = loop.call_soon_threadsafe

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal step_thread_calls
        # The thread that routes outputs: the step thread, or the reader of a core process's pipe.
        if threading.current_thread().name in ("asyncllm-step", "asyncllm-core-reader"):
            step_thread_calls += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        engine, _ = make_engine(step_delay=0.001)
        streams = [engine.add_request([i + 1, 2, 3], SamplingParams(max_tokens=30)) for i in range(50)]
        chunks = await asyncio.gather(*(_read(s, 0.0) for s in streams))
    finally:
        del loop.call_soon_threadsafe
    num_tokens = sum(len(c.token_ids) for cs, _ in chunks for c in cs)
    assert num_tokens == 50 * 30
    assert 0 < step_thread_calls <= engine.stats()["num_steps"] < num_tokens / 10


async def test_chunks_handed_over_with_wake_ups_never_lost(make_engine: EngineFactory, bpe_tokenizer: object) -> None:
    """An engine stepping flat out while many readers wait: each wake-up hands its waiting reader the merged
    chunk, and output that arrives before that reader runs again (a second wake-up of the same reader) waits
    in its slot for the next read: every token arrives once, in order. A stress test: a tiny GIL switch
    interval makes the step thread post in the middle of the loop's wake-ups (a flush that took output for
    an already woken reader lost it here in about one run in three)."""
    prompts = [[(5 * i + j) % 383 + 1 for j in range(4)] for i in range(32)]
    params = [SamplingParams(max_tokens=150)] * 32
    expected = offline_run(fake_built(bpe_tokenizer), prompts, params)
    engine, _ = make_engine(step_delay=0.0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the step thread posts in the middle of the loop's wake-ups, often
    try:
        streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        results = await asyncio.gather(*(_read(s, delay=0.0) for s in streams))
    finally:
        sys.setswitchinterval(interval)
    for (chunks, _), (tokens, text) in zip(results, expected):
        assert [t for c in chunks for t in c.token_ids] == tokens
        assert "".join(c.text for c in chunks) == text
        assert chunks[-1].finish_reason == "length"
    await wait_drained(engine)
