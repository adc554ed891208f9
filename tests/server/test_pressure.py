"""The server under pressure (issue 22): each engine error answers with its own status (400 the client's
fault, 429 overload with Retry-After, 500 an engine failure naming it, 503 dead, stalled or draining), a
max_tokens with no room is a 400, the queue and the refusals show in /metrics, and a stuck step turns
/health to 503 within the engine's bound while /health/live tells a drain from a death."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.fixtures.fake_core import FakeBuilt, fake_built
from tests.server.conftest import MODEL, metric_value
from tests.server.serving import RunningServer, start_server

FAIL_MARK = 383  # a prompt starting with this id makes the core fail to admit it (the engine's fault)


class _AdmitFails:
    """An engine core whose `add_request` fails for prompts that start with FAIL_MARK, as building one
    request's state could; the rest of the core is untouched."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def add_request(self, request: Any) -> None:
        self._core.add_request(request)
        if request.prompt_token_ids[0] == FAIL_MARK:
            raise RuntimeError("DecodeStream refused this prompt")


@pytest.fixture
def pressed() -> Iterator[tuple[AsyncLLMEngine, FakeBuilt, RunningServer]]:
    """A model-free engine with one seat and room for two waiting requests, behind its own server."""
    built = fake_built(None, step_delay=0.002, max_model_len=4096, num_kv_blocks=2048, max_num_seqs=1)
    wrapped = FakeBuilt(_AdmitFails(built.core), None, built.runtime, built.executor, None)  # type: ignore[arg-type]
    engine = AsyncLLMEngine.from_builder(lambda: wrapped, max_waiting_requests=2, max_step_seconds=0.5)
    running = start_server(create_app(engine, served_model_name="fake"))
    yield engine, built, running
    running.stop()
    engine.shutdown()


def _completion(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


async def _wait(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


async def test_overload_is_429_with_retry_after_and_counted(
    pressed: tuple[AsyncLLMEngine, FakeBuilt, RunningServer],
) -> None:
    engine, _, running = pressed
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        body = {"model": "fake", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": [1, 2, 3]}) as seat:
            await _wait(lambda: engine.stats()["num_running"] == 1 and engine.stats()["num_queued"] == 0)
            short = {"model": "fake", "max_tokens": 2, "ignore_eos": True}
            waiting = [
                asyncio.create_task(http.post("/v1/completions", json={**short, "prompt": [4, i]})) for i in (5, 6)
            ]
            await _wait(lambda: engine.stats()["num_queued"] == 2)
            r = await http.post("/v1/completions", json={**short, "prompt": [7, 8]})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["code"] == "engine_overloaded" and "max_waiting_requests=2" in error["message"]
            assert metric_value(running, "asyncllm_num_requests_queued", model_name="fake") == 2
            assert metric_value(running, "asyncllm_num_requests_rejected_total", model_name="fake") == 1
            with (
                openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0) as client,
                pytest.raises(openai.RateLimitError),
            ):
                await asyncio.to_thread(client.completions.create, model="fake", prompt=[9], max_tokens=1)
            await seat.aclose()  # the seat frees: both waiting requests run, nothing accepted was lost
        for task in waiting:
            response = await task
            assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert engine.stats()["num_rejected"] == 2


async def test_priority_over_http_orders_the_queue(pressed: tuple[AsyncLLMEngine, FakeBuilt, RunningServer]) -> None:
    """`priority` in the body (vLLM's extra) reaches the engine: with the one seat held by a priority-0
    stream, a priority -1 request preempts it and finishes while a priority 3 one, sent first, waits for
    the seat; a priority that is not an integer is a 400 naming it."""
    engine, _, running = pressed
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        body = {"model": "fake", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": [1, 2, 3]}) as seat:
            await _wait(lambda: engine.stats()["num_running"] == 1)
            short = {"model": "fake", "max_tokens": 2, "ignore_eos": True}
            later = asyncio.create_task(http.post("/v1/completions", json={**short, "prompt": [4, 5], "priority": 3}))
            await _wait(lambda: engine.stats()["num_queued"] == 1)
            first = await http.post("/v1/completions", json={**short, "prompt": [6, 7], "priority": -1})
            assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] == "length"
            assert not later.done() and engine.stats()["num_queued"] == 1  # still behind the seat
            await seat.aclose()
        assert (await later).status_code == 200
        bad = await http.post("/v1/completions", json={**short, "prompt": [1], "priority": "high"})
        assert bad.status_code == 400 and "priority" in bad.text


def test_chat_takes_a_priority(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_body={"priority": 7})
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_engine_failure_of_one_request_is_500_naming_it(
    pressed: tuple[AsyncLLMEngine, FakeBuilt, RunningServer],
) -> None:
    """Regression (issue 22): the engine's failure to admit a request answered 400 (InvalidRequestError,
    blaming the client); it is a 500 whose message names the failure, and the server serves on."""
    _, _, running = pressed
    r = _completion(running.url, [FAIL_MARK, 1, 2], 4)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "request_failed"
    assert "failed to admit this request" in error["message"] and "DecodeStream refused" in error["message"]
    body = {"model": "fake", "prompt": [FAIL_MARK, 1], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=30) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and '"code":"request_failed"' in events[-1]  # after the headers: an event
    assert _completion(running.url, [1, 2], 4).status_code == 200


def test_no_room_for_max_tokens_is_400(client: openai.OpenAI, server: RunningServer) -> None:
    """Regression (issue 22): max_tokens larger than the context leaves was accepted silently; OpenAI and
    vLLM answer 400, naming the field. For a text prompt too (its length is known once tokenized)."""
    with pytest.raises(openai.BadRequestError, match=r"max_tokens=600 does not fit.*leaves room for") as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=600)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "max_tokens"
    long_prompt = [5, 6, 7, 8] * 125  # 500 tokens of max_model_len's 512: room for 12
    with pytest.raises(openai.BadRequestError, match=r"has 500 tokens .* leaves room for 12") as info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=13)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="does not fit"):
        client.completions.create(model=MODEL, prompt="Hello there", max_tokens=510)
    ok = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=12, extra_body={"ignore_eos": True})
    assert ok.usage is not None and ok.usage.completion_tokens == 12
    # Streamed with a text prompt: the headers went before tokenizing; the refusal is the error event.
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 510, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=30) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert '"type":"invalid_request_error"' in events[-1] and '"param":"max_tokens"' in events[-1]


@pytest.mark.slow
async def test_a_stuck_step_turns_health_to_503_within_the_bound() -> None:
    """The engine's max_step_seconds (0.5 here) is the server's bound: /health and /health/live turn 503
    (code engine_stalled) once a step has run past it, and 200 again when it returns."""
    release = threading.Event()
    stuck = threading.Event()

    def next_token(seq: Any) -> int:
        if len(seq) > 3:  # from the prompt's second token on: stuck until released
            stuck.set()
            assert release.wait(30)
        return 1

    built = fake_built(None, next_token=next_token, max_model_len=4096)
    engine = AsyncLLMEngine.from_builder(lambda: built, max_step_seconds=0.5)
    running = start_server(create_app(engine, served_model_name="fake"))
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            task = asyncio.create_task(
                http.post("/v1/completions", json={"model": "fake", "prompt": [1, 2, 3], "max_tokens": 5})
            )
            assert await asyncio.to_thread(stuck.wait, 5)
            t0 = time.monotonic()
            while (r := await http.get("/health")).status_code == 200:
                await asyncio.sleep(0.02)
            turned = time.monotonic() - t0
            assert 0.3 < turned < 1.0, turned  # the step got stuck a little before t0
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled"
            assert "bound 0.5 s" in r.json()["error"]["message"]
            assert (await http.get("/health/live")).status_code == 503
            release.set()
            assert (await task).status_code == 200
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/health/live")).json() == {"status": "ok"}
    finally:
        release.set()
        running.stop()
        engine.shutdown()


async def test_draining_is_503_for_new_requests_and_health_but_not_liveness(
    pressed: tuple[AsyncLLMEngine, FakeBuilt, RunningServer],
) -> None:
    engine, _, running = pressed
    async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        in_flight = asyncio.create_task(
            http.post("/v1/completions", json={"model": "fake", "prompt": [1, 2], "max_tokens": 60, "ignore_eos": True})
        )
        await _wait(lambda: engine.stats()["num_running"] == 1)
        draining = asyncio.create_task(engine.drain(timeout=20))
        await _wait(lambda: engine.is_draining)
        r = await http.post("/v1/completions", json={"model": "fake", "prompt": [3], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_draining"
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_draining"
        assert (await http.get("/health/live")).json() == {"status": "draining"}
        done = await in_flight  # finishes whole
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 60
        assert await draining == 0
