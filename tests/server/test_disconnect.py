"""A client that leaves aborts its requests: streamed (connection closed mid-stream) and not (client timeout).
Every block is free within a second and the abort is counted; nothing keeps generating for nobody."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.server.conftest import MODEL, metric_value, wait_drained
from tests.server.serving import RunningServer

LONG = {"ignore_eos": True}  # with max_tokens near max_model_len: seconds of work if nobody stops it


async def test_streaming_client_that_disconnects_aborts(
    aclient: openai.AsyncOpenAI, engine: AsyncLLMEngine, server: RunningServer
) -> None:
    aborted = metric_value(server, "vllm:request_success_total", finished_reason="abort")
    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me everything"}],
        max_tokens=480,
        stream=True,
        extra_body=LONG,
    )
    seen = 0
    async for chunk in stream:
        seen += len(chunk.choices[0].delta.content or "")
        if seen >= 5:
            break
    assert engine.stats()["num_running"] == 1  # still generating when the client leaves
    await stream.close()
    t0 = time.monotonic()
    stats = wait_drained(engine, timeout=1.0)
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and time.monotonic() - t0 < 1.0
    assert metric_value(server, "vllm:request_success_total", finished_reason="abort") == aborted + 1


@pytest.mark.parametrize("n", [1, 3])
def test_non_streaming_client_that_gives_up_aborts(server: RunningServer, engine: AsyncLLMEngine, n: int) -> None:
    aborted = metric_value(server, "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 500, "n": n, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=0.15)  # ~500 tokens take longer
    stats = wait_drained(engine, timeout=1.0)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert metric_value(server, "vllm:request_success_total", finished_reason="abort") == aborted + n


def test_raw_stream_closed_after_the_role_chunk_aborts(server: RunningServer, engine: AsyncLLMEngine) -> None:
    """Leaving before any token arrived (the events generator never reached the engine streams) aborts too."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 480, "n": 2, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**body, **LONG}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    wait_drained(engine, timeout=1.0)


async def test_client_gone_before_the_first_event_aborts(engine: AsyncLLMEngine) -> None:
    """The response fails on its very first send, so the event generator never starts (closing an unstarted
    generator runs none of its code): the requests must be aborted all the same (regression)."""
    app = create_app(engine, served_model_name=MODEL)
    metrics = app.state.asyncllm.metrics
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 480, "stream": True, "n": 2}
    messages = [{"type": "http.request", "body": json.dumps({**body, **LONG}).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client never says more
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        raise OSError("connection reset by peer")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "headers": [(b"content-type", b"application/json")],
    }
    with pytest.raises(OSError):
        await app(scope, receive, send)
    await asyncio.to_thread(wait_drained, engine, 1.0)
    assert b'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 2.0' in metrics.render()
