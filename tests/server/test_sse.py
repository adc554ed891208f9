"""The exact wire format of streamed responses, read raw (no client library smoothing it over): one JSON
object per `data:` event, each choice's role first, the finish reason on an empty last delta, `usage` null on
every chunk and filled on a final choice-less one when asked for, then `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.server.conftest import MODEL
from tests.server.serving import RunningServer


def _events(server: RunningServer, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    assert raw.endswith("\n\n") and not raw.startswith("\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def test_chat_stream_shape(server: RunningServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    events = _events(
        server, "/chat/completions", {**body, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    )
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL and "usage" in e for e in events)
    assert len({(e["id"], e["created"]) for e in events}) == 1
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert all(e["usage"] is None and len(e["choices"]) == 1 for e in chunks)
    for index in (0, 1):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""} and mine[0]["finish_reason"] is None
        assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in mine[1:-1])
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"


def test_chat_stream_without_usage_has_no_usage_key(server: RunningServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    events = _events(server, "/chat/completions", body)
    assert all("usage" not in e and len(e["choices"]) == 1 for e in events)


def test_completion_stream_shape(server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True}
    events = _events(server, "/completions", {**body, "stream_options": {"include_usage": True}})
    *chunks, last = events
    assert all(e["object"] == "text_completion" for e in events)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    choices = [e["choices"][0] for e in chunks]
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason"} for c in choices)
    assert [c["finish_reason"] for c in choices][-1] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])
