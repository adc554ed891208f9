"""Per-request deadlines through the server: the `timeout` field, `--request-timeout` as its default and its
most (`create_app(request_timeout=)`), a streamed reply ending with finish_reason "timeout" and `[DONE]`, a
request that timed out before any output answered 408 (`request_timeout`), a bad value a 400 naming
`timeout`, and the timeouts counted in /metrics."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.fixtures.fake_core import fake_built
from tests.server.conftest import metric_value
from tests.server.serving import RunningServer, start_server


@pytest.fixture(scope="module")
def slow() -> Iterator[RunningServer]:
    """A model-free engine with one seat, steps of 2 ms, and a server default timeout of 2 s."""
    built = fake_built(None, step_delay=0.002, max_model_len=4096, num_kv_blocks=2048, max_num_seqs=1)
    engine = AsyncLLMEngine.from_builder(lambda: built)
    running = start_server(create_app(engine, served_model_name="fake", request_timeout=2.0))
    yield running
    running.stop()
    engine.shutdown()


def _post(server: RunningServer, path: str, **body: Any) -> httpx.Response:
    body = {"model": "fake", "ignore_eos": True, **body}
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_a_streamed_reply_ends_with_timeout_then_done(slow: RunningServer) -> None:
    before = metric_value(slow, "vllm:request_success_total", finished_reason="timeout")
    events = []
    body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{slow.url}/v1/completions", json={**body, "timeout": 0.3}, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "timeout"
    assert metric_value(slow, "vllm:request_success_total", finished_reason="timeout") == before + 1


def test_no_output_before_the_timeout_is_a_408(slow: RunningServer) -> None:
    # The one seat is taken: the second request waits, past its timeout, with no output.
    blocker = threading.Thread(target=_post, args=(slow, "/v1/completions"), kwargs={"prompt": [1], "max_tokens": 400})
    blocker.start()
    try:
        deadline = time.monotonic() + 5
        while metric_value(slow, "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the blocker never started"
            time.sleep(0.005)
        r = _post(slow, "/v1/completions", prompt=[2, 3], max_tokens=5, timeout=0.05)
    finally:
        blocker.join()
    assert r.status_code == 408, r.text
    error = r.json()["error"]
    assert error["code"] == "request_timeout" and "timeout" in error["message"]


def test_the_server_default_applies_and_caps(slow: RunningServer) -> None:
    """No `timeout`: the server's 2 s; a `timeout` above it: still 2 s (a reply of 4,000 tokens at 2 ms a
    step takes 8 s, so both end by their deadline)."""
    for extra in ({}, {"timeout": 60}):
        r = _post(slow, "/v1/completions", prompt=[1, 2], max_tokens=4000, **extra)
        assert r.status_code == 200
        assert r.json()["choices"][0]["finish_reason"] == "timeout"


@pytest.mark.parametrize("value", [0, -1, "soon"])
def test_a_bad_timeout_is_a_400_naming_it(slow: RunningServer, value: object) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": [1, 2]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = _post(slow, path, max_tokens=2, timeout=value, **body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "timeout"


def test_request_timeout_must_be_seconds() -> None:
    engine = AsyncLLMEngine.from_builder(lambda: fake_built(None))
    try:
        with pytest.raises(ValueError, match="request_timeout"):
            create_app(engine, request_timeout=0)
    finally:
        engine.shutdown()
