"""A client that leaves aborts its requests: streamed (connection closed mid-stream) and not (client timeout).
Every block is free within a second and the abort is counted; nothing keeps generating for nobody."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from tests.server.conftest import MODEL, metric_value, wait_drained
from tests.server.serving import RunningServer

LONG = {"ignore_eos": True}  # with max_tokens near max_model_len: seconds of work if nobody stops it


async def test_streaming_client_that_disconnects_aborts(
    aclient: openai.AsyncOpenAI, engine: AsyncLLMEngine, server: RunningServer
) -> None:
    aborted = metric_value(server, "asyncllm_requests_total", finish_reason="abort")
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
    assert metric_value(server, "asyncllm_requests_total", finish_reason="abort") == aborted + 1


@pytest.mark.parametrize("n", [1, 3])
def test_non_streaming_client_that_gives_up_aborts(server: RunningServer, engine: AsyncLLMEngine, n: int) -> None:
    aborted = metric_value(server, "asyncllm_requests_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 500, "n": n, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=0.3)
    stats = wait_drained(engine, timeout=1.0)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert metric_value(server, "asyncllm_requests_total", finish_reason="abort") == aborted + n


def test_raw_stream_closed_after_the_role_chunk_aborts(server: RunningServer, engine: AsyncLLMEngine) -> None:
    """Leaving before any token arrived (the events generator never reached the engine streams) aborts too."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 480, "n": 2, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**body, **LONG}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    wait_drained(engine, timeout=1.0)
