"""`engine.chat` with `SamplingParams(n=...)` on the tiny model (CPU): n replies as one request, each equal to
a chat of its own seeded s + i (text, reasoning, tool calls, finish reason), chunks labelled by `index` and
never mixed, forced tool calls parsing in every reply, and leaving early freeing every block."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from asyncllm import AsyncLLMEngine, ChatChunk, SamplingParams
from asyncllm.parsing import merge_tool_call_deltas
from tests.async_engine.conftest import wait_drained
from tests.async_engine.test_chat import ASK, ENGINE_ARGS, SCHEMAS, TOOLS
from tests.fixtures.chat_templates import HERMES, THINKING
from tests.fixtures.tiny_models import build_checkpoint

SEARCH = {"type": "function", "function": {"name": "search"}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    path = build_checkpoint(tmp_path_factory.mktemp("chat_n") / "qwen3", "qwen3", max_position_embeddings=4096)
    engine = AsyncLLMEngine(str(path), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def reply(chunks: list[ChatChunk]) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """One reply's text, reasoning, calls (name, arguments: ids are random) and finish reason."""
    calls = merge_tool_call_deltas(d for c in chunks for d in c.tool_calls)
    text, reasoning = "".join(c.text for c in chunks), "".join(c.reasoning_text for c in chunks)
    return text, reasoning, [(c.name, c.arguments) for c in calls], chunks[-1].finish_reason


def by_index(chunks: list[ChatChunk], n: int) -> list[list[ChatChunk]]:
    """Each reply's chunks; every reply ends with its finish reason, and nothing of it comes after."""
    replies: list[list[ChatChunk]] = [[] for _ in range(n)]
    for chunk in chunks:
        mine = replies[chunk.index]
        assert not mine or mine[-1].finish_reason is None, "a chunk after its reply's finish reason"
        assert not chunk.empty
        mine.append(chunk)
    assert all(r and r[-1].finish_reason is not None for r in replies)
    assert chunks[-1].finish_reason is not None  # the stream ends with the last reply's end
    return replies


CASES = [
    pytest.param(dict(chat_template=THINKING), id="reasoning"),
    pytest.param(dict(chat_template=THINKING, tools=TOOLS), id="reasoning-tools-auto"),
    pytest.param(
        dict(chat_template=HERMES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
        id="required",
        marks=pytest.mark.needs_structured_output,
    ),
    pytest.param(
        dict(chat_template=HERMES, tools=TOOLS, tool_choice=SEARCH),
        id="named",
        marks=pytest.mark.needs_structured_output,
    ),
]


@pytest.mark.parametrize("kwargs", CASES)
async def test_replies_equal_chats_seeded_seed_plus_index(engine: AsyncLLMEngine, kwargs: dict[str, Any]) -> None:
    forced = kwargs.get("tool_choice") is not None  # a forced call ends at EOS once whole: room for it
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=200 if forced else 24)
    stream = engine.chat(ASK, params, **kwargs)
    chunks = [c async for c in stream]
    replies = by_index(chunks, 3)
    assert {c.index for c in chunks} == {0, 1, 2}
    generated = 0
    for i, mine in enumerate(replies):
        alone_stream = engine.chat(ASK, dataclasses.replace(params, n=1, seed=11 + i), **kwargs)
        alone = [c async for c in alone_stream]
        assert all(c.index == 0 for c in alone)
        assert reply(mine) == reply(alone), i
        assert alone_stream.metrics is not None
        generated += alone_stream.metrics.num_generated_tokens
    assert len({json.dumps(reply(r)) for r in replies}) > 1  # the samples differ
    assert stream.metrics is not None and stream.metrics.num_generated_tokens == generated
    assert stream.prompt_token_ids == alone_stream.prompt_token_ids
    if forced:  # every reply's call parses and fits its schema
        for mine in replies:
            text, _, calls, finish = reply(mine)
            assert finish == "tool_calls" and len(calls) == 1 and not text.strip(), mine
            name, arguments = calls[0]
            assert name in (SCHEMAS if kwargs["tool_choice"] == "required" else {"search"})
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    await wait_drained(engine)


@pytest.mark.parametrize("how", ["break", "cancel", "aclose"])
@pytest.mark.slow
async def test_leaving_a_chat_of_samples_early_frees_every_block(engine: AsyncLLMEngine, how: str) -> None:
    stream = engine.chat(ASK, SamplingParams(n=3, max_tokens=400, ignore_eos=True))
    if how == "break":
        async for _ in stream:
            break
        del stream
    elif how == "cancel":
        task = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait([task])
    else:
        await stream.__anext__()
        await stream.aclose()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    stats = await wait_drained(engine, timeout=10)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
