"""GET /health: 200 while the engine is busy (it reads a flag, it does not queue behind work), 503 in OpenAI's
error shape once the engine died (a fault in its step loop) or was shut down; live streams then end with an
error event and new requests get 503."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.fixtures.fake_core import FakeBuilt, fake_built
from tests.server.conftest import MODEL, wait_drained
from tests.server.serving import RunningServer, start_server


async def test_health_answers_while_generating(
    server: RunningServer, aclient: openai.AsyncOpenAI, engine: AsyncLLMEngine
) -> None:
    async def long_stream(i: int) -> None:
        stream = await aclient.completions.create(
            model=MODEL, prompt=[5, 6, 7 + i], max_tokens=480, stream=True, extra_body={"ignore_eos": True}
        )
        async for _ in stream:
            pass

    tasks = [asyncio.create_task(long_stream(i)) for i in range(8)]
    async with httpx.AsyncClient(base_url=server.url) as http:
        while engine.stats()["num_running"] < 8:
            await asyncio.sleep(0.005)
        latencies = []
        for _ in range(10):
            t0 = time.perf_counter()
            r = await http.get("/health")
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert engine.stats()["num_running"] == 8  # all of it ran while the generations did
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert max(latencies) < 0.5, latencies
    wait_drained(engine, timeout=1.0)


@pytest.fixture
def fake() -> Iterator[tuple[AsyncLLMEngine, FakeBuilt, RunningServer]]:
    """An engine around a model-free core (token ids only) that a test can make fail, behind its own server."""
    built = fake_built(None, step_delay=0.005, max_model_len=4096, num_kv_blocks=2048)
    engine = AsyncLLMEngine.from_builder(lambda: built)
    running = start_server(create_app(engine, served_model_name="fake"))
    yield engine, built, running
    running.stop()
    engine.shutdown()


def test_dead_engine_is_503_everywhere(fake: tuple[AsyncLLMEngine, FakeBuilt, RunningServer]) -> None:
    engine, built, running = fake
    assert httpx.get(f"{running.url}/health").status_code == 200
    with openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0) as client:
        stream = client.completions.create(model="fake", prompt=[1, 2, 3], max_tokens=2000, stream=True)
        while engine.stats()["num_running"] == 0:
            time.sleep(0.005)
        built.executor.fail_after_steps = built.executor.num_steps  # the next forward pass raises
        with pytest.raises(openai.APIError, match="not serving"):  # the error event of the live stream
            for _ in stream:
                pass
        r = httpx.get(f"{running.url}/health")
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "engine_dead" and "InjectedFailure" in error["message"]
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="fake", prompt=[1, 2, 3], max_tokens=2)
        assert info.value.status_code == 503


def test_shut_down_engine_is_503(fake: tuple[AsyncLLMEngine, FakeBuilt, RunningServer]) -> None:
    engine, _, running = fake
    engine.shutdown()
    r = httpx.get(f"{running.url}/health")
    assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]
