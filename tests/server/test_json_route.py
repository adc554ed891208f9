"""The generation endpoints' plain routes (`json_route`) read and refuse a body exactly as FastAPI's own body
parameter did: for every content type and body below, the same status and the same OpenAI error body (message,
param) from the fast route as from a FastAPI endpoint over the same model. In process, no engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncllm.server.errors import install_error_handlers
from asyncllm.server.json_route import json_route
from asyncllm.server.protocol import ChatCompletionRequest, CompletionRequest

_JSON = "application/json"
_CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
_COMPLETION = {"model": "m", "prompt": [1, 2]}


def _bodies(good: dict[str, Any]) -> list[tuple[bytes, str | None]]:
    whole = json.dumps(good).encode()
    edits: list[dict[str, Any]] = [
        {"model": None},
        {"temperature": "hot"},
        {"temperature": "0.5"},
        {"n": 0},
        {"unknown_knob": 1},
        {"body": 1},  # a field named like FastAPI's location prefix
        {"stream_options": {"bad": 1}},
        {"stop": 5},
        {"max_tokens": 1.5},
        {"seed": True},
    ]
    if "messages" in good:
        edits += [{"messages": [{"role": "user"}]}, {"messages": [{"role": "bot", "content": "x"}]}, {"messages": "x"}]
        edits += [{"response_format": {"type": "xml"}}, {"messages": [{"role": "user", "content": "x", "extra": 1}]}]
    else:
        edits += [{"prompt": None}, {"logprobs": "many"}]
    given = [(json.dumps({**good, **edit}).encode(), _JSON) for edit in edits]
    return [
        *given,
        (whole, _JSON),
        (b"{not json", _JSON),
        (b"\xc3\x28", _JSON),  # not UTF-8
        (b"", _JSON),
        (b"", None),
        (whole, None),  # no content type: not read as JSON (FastAPI's strict content type)
        (whole, "text/plain"),
        (whole, "application/vnd.api+json"),
        (whole, " APPLICATION/JSON ; charset=utf-8"),
        (whole, "application/json/x"),
        (b"[1, 2]", _JSON),
        (b"null", _JSON),
        (b'"text"', _JSON),
    ]


def _apps(model: type[Any]) -> tuple[FastAPI, FastAPI]:
    async def echo(body: Any, request: Request) -> Response:
        return JSONResponse(body.model_dump(mode="json"))

    fast = FastAPI()
    install_error_handlers(fast)
    fast.router.routes.append(json_route("/x", model, echo))
    slow = FastAPI()
    install_error_handlers(slow)

    async def endpoint(body: Any, request: Request) -> Response:
        return await echo(body, request)

    endpoint.__annotations__ = {"body": model, "request": Request, "return": Response}  # as the server's were
    slow.post("/x")(endpoint)
    return fast, slow


@pytest.mark.parametrize(("model", "good"), [(ChatCompletionRequest, _CHAT), (CompletionRequest, _COMPLETION)])
def test_the_plain_route_reads_and_refuses_bodies_as_fastapi_does(model: type[Any], good: dict[str, Any]) -> None:
    async def answers(app: FastAPI) -> list[tuple[int, Any]]:
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            for body, content_type in _bodies(good):
                headers = {} if content_type is None else {"content-type": content_type}
                r = await client.post("/x", content=body, headers=headers)
                out.append((r.status_code, r.json()))
            r = await client.get("/x")
            out.append((r.status_code, r.json()))
        return out

    fast, slow = _apps(model)
    fast_answers, slow_answers = asyncio.run(answers(fast)), asyncio.run(answers(slow))
    assert fast_answers == slow_answers
    statuses = [status for status, _ in fast_answers]
    assert statuses.count(200) >= 4 and statuses.count(400) >= 15 and statuses[-1] == 405


def test_a_client_gone_before_its_body_is_a_499_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: the plain route let Starlette's ClientDisconnect out of the body read, and every client
    that left early was logged as an unexpected error, traceback and all (tests/server/test_many_clients)."""
    fast, _ = _apps(CompletionRequest)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/x", "headers": [(b"content-type", b"application/json")]}
    scope |= {"query_string": b"", "root_path": "", "scheme": "http", "server": ("t", 80), "http_version": "1.1"}
    asyncio.run(fast(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
