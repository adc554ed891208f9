"""`add_request(..., timeout=)` through the async engine: a running request ends with a "timeout" chunk after
its output, a waiting one raises `RequestTimeoutError` from its stream, both free their blocks; text and
token prompts and `generate` take it (`chat`: tests/async_engine/test_chat.py); a bad timeout is refused at
once naming it."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.errors import RequestTimeoutError
from tests.async_engine.conftest import EngineFactory, wait_drained
from tests.fixtures.chat_templates import HERMES

ENDLESS = SamplingParams(max_tokens=4000, ignore_eos=True)


@pytest.mark.core_process
async def test_a_running_request_ends_with_timeout_after_its_output(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(step_delay=0.002, max_model_len=4096)
    chunks = [c async for c in engine.stream([1, 5, 9], ENDLESS, timeout=0.3)]
    assert chunks[-1].finish_reason == "timeout" and chunks[-1].metrics is not None
    assert 0 < sum(len(c.token_ids) for c in chunks) < 4000
    assert chunks[-1].metrics.e2e_latency is not None and chunks[-1].metrics.e2e_latency >= 0.3
    await wait_drained(engine)


@pytest.mark.core_process
async def test_a_waiting_request_raises_request_timeout_error(make_engine: EngineFactory) -> None:
    # One seat: the second request waits behind the first, past its own timeout.
    engine, _ = make_engine(step_delay=0.002, max_model_len=4096, max_num_seqs=1)
    first = engine.stream([1, 5, 9], SamplingParams(max_tokens=300, ignore_eos=True))
    reader = asyncio.create_task(_read(first))
    with pytest.raises(RequestTimeoutError, match="gave no output within its timeout"):
        await engine.generate([2, 4, 6], ENDLESS, timeout=0.1)
    assert (await reader)[-1].finish_reason == "length"  # the first ran on, untouched
    await wait_drained(engine)


async def test_text_prompts_take_a_timeout(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(step_delay=0.002, max_model_len=4096)
    out = await engine.generate("hello there", ENDLESS, timeout=0.2)
    assert out.finish_reason == "timeout" and out.token_ids
    await wait_drained(engine)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "5", True])
async def test_a_bad_timeout_is_refused_naming_it(make_engine: EngineFactory, timeout: object) -> None:
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError, match="timeout="):
        engine.add_request([1, 2, 3], timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="timeout="):
        engine.chat([{"role": "user", "content": "hi"}], chat_template=HERMES, timeout=timeout)  # type: ignore[arg-type]
    assert engine.stats()["num_running"] == 0


async def _read(stream):  # type: ignore[no-untyped-def]
    return [c async for c in stream]
