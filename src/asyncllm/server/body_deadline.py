"""A request body's read deadline inside the app (issue 39), for an app mounted in a server of its own
choosing (its own uvicorn, Hypercorn, an ASGI gateway), which sets no read timeout of its own (uvicorn sets
none). `asyncllm serve` bounds a request's headers and body in uvicorn's HTTP protocol (connections.py); an
ASGI app sees a request only once its headers are in, so here the bound is on its body: the whole body must
arrive within `seconds` of the app being called. Past it the client gets a 408 (`connection: close`, so the
server closes the connection after it) unless something was answered already, and the app sees the client
gone: the request ends before the engine sees it. Nothing after the body is bounded: a stream runs as long
as it generates. The headers' time, idle connections and connection counts stay the server's to bound
(docs/server.md: Connections). Knows nothing of the endpoints.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_GONE: Message = {"type": "http.disconnect"}


async def _nothing() -> None:
    return None


def _timed_out(seconds: float) -> tuple[Message, Message]:
    error = {
        "message": f"the request's body was not received within {seconds:g} s of its headers: the connection is "
        "closed (send it faster, or raise the server's body read timeout)",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_timeout",
    }
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return {"type": "http.response.start", "status": 408, "headers": headers}, {
        "type": "http.response.body",
        "body": body,
    }


class BodyReadDeadline:
    """ASGI middleware: each HTTP request's body within `seconds` of the call (see the module's docstring)."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        if not 0 < seconds < float("inf"):
            raise ValueError(f"BodyReadDeadline: seconds must be > 0 and finite, got {seconds!r}")
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.seconds
        exchange: dict[str, Any] = {"read": False, "answered": False, "expired": False}

        async def read() -> Message:
            if exchange["expired"]:
                return _GONE
            if exchange["read"]:
                return await receive()  # past the body: a disconnect, whenever it comes
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(receive(), max(remaining, 0.0))
            except asyncio.TimeoutError:
                exchange["expired"] = True
                if not exchange["answered"]:
                    for part in _timed_out(self.seconds):
                        await send(part)
                return _GONE
            if message["type"] != "http.request" or not message.get("more_body", False):
                exchange["read"] = True
            return message

        def answer(message: Message) -> Awaitable[None]:
            """The app's send: passed on (no coroutine of its own: a stream sends a message a token)."""
            if exchange["expired"]:
                return _nothing()  # the 408 (or the cut) was the answer: the app's own goes nowhere
            if message["type"] == "http.response.start":
                exchange["answered"] = True
            return send(message)

        await self.app(scope, read, answer)
