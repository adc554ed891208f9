"""The wire: server-sent events and the client's connection.

Owns SSE framing (`data: {json}\\n\\n` as bytes, a final `data: [DONE]`), the frames of one streamed
response made from a template (`ChunkFrames`: the fields every chunk repeats are encoded once, so a chunk
costs the encoding of its own choice), a streaming response that always closes its event generator (so a
client that leaves aborts its engine requests, whatever the ASGI server or Starlette version does with the
half-read iterator), and cancelling non-streamed work when the client disconnects. Knows nothing of
OpenAI's fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
# json.dumps(..., ensure_ascii=False, separators=(",", ":")) without building an encoder per call.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
encode_str = json.encoder.encode_basestring  # a str as JSON, as `_encode` writes it


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload).encode() + b"\n\n"


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    """A named event (`event: name` before its data), as the Responses and Messages APIs send theirs."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(payload).encode() + b"\n\n"


class ChunkFrames:
    """The SSE frames of one streamed response: `{**base, "choices": [choice]}` each, with `base` (id,
    created, model, object, ...) encoded once. `frame(choice)` gives exactly the bytes `sse` would."""

    __slots__ = ("_base", "_head", "_tail")

    def __init__(self, base: dict[str, Any]) -> None:
        assert base and "choices" not in base
        self._base = base
        self._head = "data: " + _encode(base)[:-1] + ',"choices":['  # "choices" comes last, as in `sse`
        self._tail = "]}\n\n"

    @property
    def base(self) -> dict[str, Any]:
        """The fields every frame repeats (with the usage last set)."""
        return self._base

    def set_usage(self, usage: dict[str, Any]) -> None:
        """The `usage` the following frames carry (continuous usage stats: re-encoded per output)."""
        self._base = {**self._base, "usage": usage}
        self._head = "data: " + _encode(self._base)[:-1] + ',"choices":['

    def frame(self, choice: dict[str, Any]) -> bytes:
        return (self._head + _encode(choice) + self._tail).encode()

    def frame_json(self, choice_json: str) -> bytes:
        """`frame` of a choice already encoded (by a caller's template for its common case)."""
        return (self._head + choice_json + self._tail).encode()


class SSEResponse(StreamingResponse):
    """A text/event-stream response over an async generator of SSE frames (bytes); however sending ends,
    the generator is closed and `on_close` runs (synchronously)."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        # no-cache and no proxy buffering: each event must reach the client as it is produced
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette's own streaming runs the sending and a disconnect listener in an anyio task group: its
        # cancel scopes and named tasks cost as much per request as the first dozen frames. The same two
        # tasks in plain asyncio (the server runs on asyncio or uvloop): whichever ends first ends the other.
        sender = asyncio.ensure_future(self._send_all(send))
        listener = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((sender, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            if not sender.done():  # the client left, or the server is shutting down: stop sending
                sender.cancel()
                await asyncio.wait((sender,))
            # The sender may have been cancelled while awaiting `send`, the generator suspended at a
            # `yield`: close it here rather than whenever it is collected. An unstarted generator runs no
            # `finally` when closed, hence `on_close` (it aborts the requests).
            try:
                await self._events.aclose()
            finally:
                self._on_close()
        if not sender.cancelled():
            sender.result()  # what sending raised (a write to a connection already gone, say)

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for frame in self._events:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        task.cancel()  # our own cancellation (server shutdown) must reach the work too


def disconnected_response() -> Response:
    """Nobody reads it; 499 (nginx's "client closed request") keeps access logs honest."""
    return Response(status_code=499)
