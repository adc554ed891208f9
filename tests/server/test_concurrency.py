"""64 streaming clients at once, each with its own prompt: every stream completes and equals the same
request's non-streamed greedy answer; afterwards the engine is drained."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from asyncllm import AsyncLLMEngine
from tests.server.conftest import MODEL, wait_drained

pytestmark = pytest.mark.slow  # starts processes or servers: seconds each

CLIENTS = 64


async def test_64_concurrent_streams_equal_their_non_streamed_answers(
    aclient: openai.AsyncOpenAI, engine: AsyncLLMEngine
) -> None:
    def request(i: int) -> dict[str, Any]:
        content = f"Question {i}: what is {i} + {i * 7 % 13}?"
        return dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8 + i % 9, temperature=0)

    async def streamed(i: int) -> tuple[str, str | None, int]:
        stream = await aclient.chat.completions.create(
            **request(i), stream=True, stream_options={"include_usage": True}
        )
        text, finish, usage = [], None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(text), finish, usage

    async def whole(i: int) -> tuple[str, str | None, int]:
        r = await aclient.chat.completions.create(**request(i))
        assert r.usage is not None
        return r.choices[0].message.content or "", r.choices[0].finish_reason, r.usage.completion_tokens

    streams = await asyncio.wait_for(asyncio.gather(*(streamed(i) for i in range(CLIENTS))), 60)
    wholes = await asyncio.wait_for(asyncio.gather(*(whole(i) for i in range(CLIENTS))), 60)
    assert streams == wholes
    assert all(finish in ("stop", "length") for _, finish, _ in streams)
    wait_drained(engine, timeout=1.0)
