"""The event loop never runs the tokenizer (issue 10, defect 2): `add_request` returns at once, requests
reach the core in arrival order, an abort before tokenization finished leaves nothing behind, what needs
the tokenizer fails from the stream, absurd texts are refused before tokenizing. Also: a stuck step makes
the engine unhealthy, and loading freezes what it left out of the garbage collector."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import time
from typing import Any

import pytest

from asyncllm import AsyncLLMEngine, EngineDeadError, EngineStalledError, InvalidRequestError, SamplingParams
from tests.async_engine.conftest import wait_drained
from tests.fixtures.fake_core import FakeBuilt, fake_built


class _GatedEncode:
    """The test tokenizer's encode, held at a gate: tokenizing waits until the test opens it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[str] = []
        self.fail_on: str | None = None

    def __call__(self, text: str) -> list[int]:
        self.entered.set()
        assert self.gate.wait(10)
        self.calls.append(text)
        if text == self.fail_on:
            raise TypeError("the tokenizer library's own complaint")
        return list(self._tokenizer.encode(text).ids)


def _gated_engine(bpe_tokenizer: Any, **kwargs: Any) -> tuple[AsyncLLMEngine, FakeBuilt, _GatedEncode]:
    built = fake_built(bpe_tokenizer, **kwargs)
    encode = _GatedEncode(bpe_tokenizer)
    built = dataclasses.replace(built, encode=encode)
    return AsyncLLMEngine.from_builder(lambda: built), built, encode


def _scheduled_order(built: FakeBuilt) -> list[str]:
    return [new.request_id for step in built.executor.steps for new in step.new_requests]


async def test_text_is_tokenized_off_the_loop_in_arrival_order(bpe_tokenizer: Any) -> None:
    """Regression (issue 10, defect 2): text prompts were tokenized on the caller's loop (512 of them
    stopped it for 0.3-1.0 s). With the tokenizer held, add_request still returns at once and the loop
    runs; requests then reach the core in the order they were added, token-id ones queued behind text."""
    engine, built, encode = _gated_engine(bpe_tokenizer, max_num_seqs=1)
    try:
        t0 = time.perf_counter()
        streams = [
            engine.add_request("first text", SamplingParams(max_tokens=2), request_id="a"),
            engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="b"),
            engine.add_request("third text", SamplingParams(max_tokens=2), request_id="c"),
            engine.add_request([7, 8], SamplingParams(max_tokens=2), request_id="d"),
        ]
        assert time.perf_counter() - t0 < 0.5
        assert streams[0].prompt_token_ids is None and streams[1].prompt_token_ids == (5, 6)
        await asyncio.sleep(0.05)  # the loop runs while the tokenizer is held
        assert await asyncio.to_thread(encode.entered.wait, 5)
        assert _scheduled_order(built) == []  # "b" waits behind "a", though it needs no tokenizer
        encode.gate.set()
        for stream in streams:
            assert [c async for c in stream][-1].finish_reason == "length"
        assert _scheduled_order(built) == ["a", "b", "c", "d"]
        assert streams[0].prompt_token_ids == tuple(bpe_tokenizer.encode("first text").ids)
        await wait_drained(engine)
    finally:
        encode.gate.set()
        engine.shutdown()


async def test_abort_before_tokenization_finished_leaves_nothing(bpe_tokenizer: Any) -> None:
    """An abort (or a dropped stream) while the prompt is still being tokenized ends the stream at once
    with "abort"; the request never reaches the core, and requests behind it still run."""
    engine, built, encode = _gated_engine(bpe_tokenizer)
    try:
        held = engine.add_request("being tokenized", SamplingParams(max_tokens=3), request_id="held")
        queued = engine.add_request("queued behind", SamplingParams(max_tokens=3), request_id="queued")
        dropped = engine.add_request([1, 2], SamplingParams(max_tokens=3), request_id="dropped")
        after = engine.add_request([3, 4], SamplingParams(max_tokens=3), request_id="after")
        assert await asyncio.to_thread(encode.entered.wait, 5)
        await engine.abort("held")
        queued.close()
        del dropped
        gc.collect()
        chunks = await asyncio.wait_for(_collect(held), 2)  # while the tokenizer is still held
        assert [c.finish_reason for c in chunks] == ["abort"] and chunks[0].token_ids == ()
        encode.gate.set()
        assert (await asyncio.wait_for(_collect(after), 5))[-1].finish_reason == "length"
        await wait_drained(engine)
        assert _scheduled_order(built) == ["after"]
        assert engine.num_live_requests == 0
        again = await engine.generate("being tokenized", SamplingParams(max_tokens=1), request_id="held")
        assert again.finish_reason == "length"  # the id is free again
    finally:
        encode.gate.set()
        engine.shutdown()


async def test_what_needs_the_tokenizer_fails_from_the_stream(bpe_tokenizer: Any) -> None:
    """A text too long in tokens, or one the tokenizer itself fails on, raises InvalidRequestError from the
    stream (add_request already returned); the engine and the other requests carry on."""
    engine, _, encode = _gated_engine(bpe_tokenizer, max_model_len=64)
    encode.gate.set()
    encode.fail_on = "tokenizer breaks"
    try:
        too_long = engine.add_request("word " * 100, SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match=r"exceeds max_model_len \(64\)"):
            await _collect(too_long)
        with pytest.raises(InvalidRequestError, match=r"tokenizer failed on this prompt.*own complaint"):
            await engine.generate("tokenizer breaks", SamplingParams(max_tokens=2))
        assert (await engine.generate("fine", SamplingParams(max_tokens=2))).finish_reason == "length"
        await wait_drained(engine)
        assert engine.is_running
    finally:
        engine.shutdown()


async def test_absurd_text_is_refused_at_once_without_tokenizing(bpe_tokenizer: Any) -> None:
    """Regression (issue 10, defect 2): the length check ran after the whole text was tokenized, so one
    4-million-character prompt held the loop 3-4 s before it was refused. A text longer than any sequence
    the engine holds could spell (max_seq_len x the vocabulary's longest token) is refused at once."""
    engine, _, encode = _gated_engine(bpe_tokenizer, max_model_len=256)
    encode.gate.set()
    try:
        t0 = time.perf_counter()
        with pytest.raises(InvalidRequestError, match="4,000,000 characters, more than any 256 tokens"):
            engine.add_request("a" * 4_000_000, SamplingParams(max_tokens=2))
        assert time.perf_counter() - t0 < 0.5 and encode.calls == []
        assert engine.num_live_requests == 0
    finally:
        engine.shutdown()


async def test_shutdown_ends_streams_still_being_tokenized(bpe_tokenizer: Any) -> None:
    """A request still in the tokenizer's queue when the engine shuts down ends with EngineDeadError at
    once, like every live stream; nothing hangs."""
    engine, built, encode = _gated_engine(bpe_tokenizer)
    try:
        held = engine.add_request("being tokenized", SamplingParams(max_tokens=3))
        queued = engine.add_request("queued behind", SamplingParams(max_tokens=3))
        assert await asyncio.to_thread(encode.entered.wait, 5)
        closing = asyncio.create_task(engine.aclose())
        for stream in (held, queued):
            with pytest.raises(EngineDeadError, match="shut down"):
                await asyncio.wait_for(_collect(stream), 2)
        encode.gate.set()  # the worker finishes its call; the engine then stops its threads
        await asyncio.wait_for(closing, 5)
        assert not engine.step_thread_alive and _scheduled_order(built) == []
    finally:
        encode.gate.set()
        engine.shutdown()


async def test_a_stuck_step_makes_the_engine_unhealthy(bpe_tokenizer: Any) -> None:
    """Regression (issue 10, also seen): a forward pass stuck for 30 s left check_health() reporting
    healthy. The age of the step in flight is tracked; past the bound the engine reports unhealthy, and
    healthy again once the step returns."""
    release = threading.Event()

    def next_token(seq: Any) -> int:
        assert release.wait(10)
        return 1

    engine = AsyncLLMEngine.from_builder(lambda: fake_built(bpe_tokenizer, next_token=next_token))
    try:
        await engine.check_health()
        stream = engine.add_request([1, 2], SamplingParams(max_tokens=1))
        # Polled: on a loaded machine the step may start well after the add (a fixed 0.3 s sleep then saw less
        # than 0.25 s of it).
        deadline = time.monotonic() + 10
        while engine.step_seconds < 0.25:
            assert time.monotonic() < deadline, "the stuck step never showed"
            await asyncio.sleep(0.01)
        await engine.check_health()  # under the default bound
        with pytest.raises(EngineStalledError, match=r"running for \d+\.\d s \(bound 0\.2 s\)"):
            await engine.check_health(max_step_seconds=0.2)
        release.set()
        assert (await _collect(stream))[-1].finish_reason == "length"
        await engine.check_health(max_step_seconds=0.2)
        assert engine.step_seconds == 0.0
    finally:
        release.set()
        engine.shutdown()


def test_loading_freezes_what_it_left_out_of_the_collector(bpe_tokenizer: Any) -> None:
    """Regression (issue 10, defect 3): full collections walked every object loading left (95-151 ms
    each, the loop stalled). After construction those are frozen: a full collection skips them."""
    gc.unfreeze()
    before = gc.get_freeze_count()
    engine = AsyncLLMEngine.from_builder(lambda: fake_built(bpe_tokenizer))
    try:
        assert before == 0 and gc.get_freeze_count() > 10_000
        # The best of five: one collection can be slowed by a loaded machine; one that walked what loading
        # left took 95-151 ms every time.
        took = []
        for _ in range(5):
            t0 = time.perf_counter()
            gc.collect()
            took.append(time.perf_counter() - t0)
        assert min(took) < 0.1, took
    finally:
        engine.shutdown()


async def _collect(stream: Any) -> list[Any]:
    return [c async for c in stream]
