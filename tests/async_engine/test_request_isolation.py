"""No request can hurt another (issue 10): one request's failure ends its stream alone, with
`InvalidRequestError` after the output it had; callers get copies, not the core's state; bad arguments
are refused naming them; a stream has one reader at a time."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from asyncllm import (
    AsyncLLMEngine,
    InvalidRequestError,
    RequestFailedError,
    RequestStream,
    SamplingParams,
    StreamInUseError,
)
from asyncllm.core.output_processor import RequestDelta
from tests.async_engine.conftest import wait_drained
from tests.fixtures.fake_core import FakeBuilt, fake_built, offline_run


class _FailOneRequest:
    """An engine core whose runner "fails" one request at its n-th token, as the core will report a failure
    of one request's sampling state: the request is finished in the core (blocks freed) and its final delta
    carries `error`. Everything else is the real core."""

    def __init__(self, core: Any, victim: str, at_token: int) -> None:
        self._core = core
        self._victim = victim
        self._at = at_token
        self._seen = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def step(self, after_execute: Callable[[], None] | None = None) -> list[RequestDelta]:
        out = []
        for delta in self._core.step(after_execute):
            if delta.request_id == self._victim and delta.finish_reason is None:
                self._seen += len(delta.new_token_ids)
                if self._seen >= self._at:
                    final = self._core.abort_request(self._victim)
                    delta = RequestDelta(
                        self._victim,
                        delta.new_token_ids,
                        delta.new_text + final.new_text,
                        "abort",
                        final.metrics,
                        error="repetition_penalty broke this request's sampling state",
                    )
            out.append(delta)
        return out


def _engine_failing(built: FakeBuilt, victim: str, at_token: int) -> AsyncLLMEngine:
    wrapped = FakeBuilt(_FailOneRequest(built.core, victim, at_token), *_rest(built))  # type: ignore[arg-type]
    return AsyncLLMEngine.from_builder(lambda: wrapped)


def _rest(built: FakeBuilt) -> tuple[Any, ...]:
    return built.tokenizer, built.runtime, built.executor, built.encode, built.encode_batch


async def test_one_request_failing_in_the_step_thread_fails_it_alone(bpe_tokenizer: Any) -> None:
    """Regression (issue 10, defect 1, second wall): a failure that belongs to one request's sampling state
    killed the engine, and every live stream died with EngineDeadError. A final delta carrying `error` now
    ends that stream alone: its tokens so far, then InvalidRequestError; the others finish as offline."""
    rng = random.Random()
    prompts = [[rng.randrange(1, 384) for _ in range(rng.randrange(2, 12))] for _ in range(12)]
    params = [SamplingParams(max_tokens=30) for _ in prompts]
    expected = offline_run(fake_built(bpe_tokenizer), prompts, params)
    engine = _engine_failing(fake_built(bpe_tokenizer, step_delay=0.001), victim="victim", at_token=5)
    try:
        victim = engine.add_request(prompts[0], params[0], request_id="victim")
        others = [engine.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:])]
        got: list[int] = []
        with pytest.raises(InvalidRequestError, match="sampling state"):
            async for chunk in victim:
                got.extend(chunk.token_ids)
                assert chunk.finish_reason is None
        assert got == expected[0][0][:5] and victim.finished
        for stream, (tokens, text) in zip(others, expected[1:]):
            chunks = [c async for c in stream]
            assert [t for c in chunks for t in c.token_ids] == tokens
            assert "".join(c.text for c in chunks) == text
        await wait_drained(engine)
        assert engine.is_running
        again = await engine.generate(prompts[0], params[0], request_id="victim-2")  # the engine carries on
        assert again.token_ids == expected[0][0]
    finally:
        engine.shutdown()


async def test_prompt_token_ids_are_an_immutable_copy(make_engine: Any) -> None:
    """Regression (issue 10, defect 5): `RequestStream.prompt_token_ids` was the core's own list; a caller
    appending to it broke max_tokens accounting and then killed the engine (an assertion in input
    preparation). It is a tuple now, a copy: the core's list never leaves it."""
    engine, _ = make_engine()
    ids = [5, 6, 7]
    stream = engine.add_request(ids, SamplingParams(max_tokens=9))
    assert stream.prompt_token_ids == (5, 6, 7)
    with pytest.raises(AttributeError):
        stream.prompt_token_ids.append(8)  # type: ignore[union-attr]
    ids.append(8)  # the caller's own list is not the core's either
    chunks = [c async for c in stream]
    assert sum(len(c.token_ids) for c in chunks) == 9 and chunks[-1].finish_reason == "length"
    text_stream = engine.add_request("Hello world", SamplingParams(max_tokens=2))
    out = [c async for c in text_stream]
    assert out[-1].finish_reason == "length" and isinstance(text_stream.prompt_token_ids, tuple)
    result = await engine.generate("Hello world", SamplingParams(max_tokens=2))
    assert result.prompt_token_ids == list(text_stream.prompt_token_ids)
    await wait_drained(engine)


@pytest.mark.parametrize("bad", [["x"], {"x": 1}, 17, "", None, b"id"])
async def test_abort_with_a_bad_id_names_the_argument(make_engine: Any, bad: object) -> None:
    """Regression (issue 10, defect 4): `abort(["x"])` raised "unhashable type" from a dict lookup."""
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError, match="request_id="):
        await engine.abort(bad)  # type: ignore[arg-type]
    await engine.abort("no-such-request")  # a well-formed unknown id is still a no-op
    assert engine.is_running


async def test_lone_surrogate_in_a_text_prompt_is_named(make_engine: Any) -> None:
    """Regression (issue 10, defect 4): a lone surrogate reached the tokenizer, whose own TypeError said
    nothing of the prompt. Refused at once as InvalidRequestError, with where it is."""
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError, match=r"prompt is not valid Unicode.*'\\ud800' at index 5"):
        engine.add_request("hello\ud800world", SamplingParams(max_tokens=2))
    assert engine.num_live_requests == 0
    out = await engine.generate("héllo wörld 😀", SamplingParams(max_tokens=2))  # valid non-ASCII is fine
    assert len(out.token_ids) == 2


async def test_a_second_reader_is_refused_not_left_waiting(make_engine: Any) -> None:
    """Regression (issue 10, also seen): a second task reading a stream another task waited on waited
    forever. It raises StreamInUseError; the first reader carries on to the end."""
    engine, _ = make_engine(step_delay=0.005)
    # 100 steps of 5 ms: the first reader must still be reading when the second tries, even if a loaded
    # machine stalls this task for a while (20 steps gave it 0.1 s).
    stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=100))

    async def read(s: RequestStream) -> int:
        return sum([len(c.token_ids) async for c in s])

    first = asyncio.create_task(read(stream))
    await asyncio.sleep(0.002)  # the first reader now waits inside __anext__
    with pytest.raises(StreamInUseError, match="already being read"):
        await asyncio.wait_for(stream.__anext__(), 2)
    assert await asyncio.wait_for(first, 10) == 100
    await wait_drained(engine)


class _AdmitFails:
    """An engine core whose `add_request` takes the request and then fails for one id, as building one
    request's state (its detokenizer, say) could: the rest of the core is untouched."""

    def __init__(self, core: Any, bad: str) -> None:
        self._core = core
        self._bad = bad

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def add_request(self, request: Any) -> None:
        self._core.add_request(request)
        if request.request_id == self._bad:
            raise ValueError("DecodeStream refused this prompt")


async def test_a_request_the_core_cannot_admit_fails_alone(bpe_tokenizer: Any) -> None:
    """Second wall, at admission: a failure while the core builds one request's state killed the engine
    (the step loop let it escape). That request ends with RequestFailedError (the engine failed it; it was
    InvalidRequestError, which blamed the caller: issue 22), whatever part of it the core took is undone
    (every block free), and the engine serves on."""
    built = fake_built(bpe_tokenizer, step_delay=0.001)
    wrapped = FakeBuilt(_AdmitFails(built.core, "bad"), *_rest(built))  # type: ignore[arg-type]
    engine = AsyncLLMEngine.from_builder(lambda: wrapped)
    try:
        good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=10))
        with pytest.raises(RequestFailedError, match=r"failed to admit this request.*DecodeStream refused") as info:
            await engine.generate([4, 5, 6], SamplingParams(max_tokens=10), request_id="bad")
        assert not isinstance(info.value, InvalidRequestError) and info.value.__cause__ is not None
        assert [c async for c in good][-1].finish_reason == "length"
        await wait_drained(engine)
        assert engine.is_running
    finally:
        engine.shutdown()
