"""POST /v1/responses: a chat turn (`chat_turn`) answered in the shapes of OpenAI's Responses API.

Owns the `response` object and its typed stream events, as the openai package's `types/responses` spell
them: `response.created`, `response.in_progress`, then per output item (reasoning, message, function call,
in the order the model wrote them) `response.output_item.added`, its content part and deltas
(`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`),
their `.done` events and `response.output_item.done`; last `response.completed` (or `response.incomplete`
when `max_output_tokens` cut the reply) carrying the usage. The whole (non-streamed) response is the same
builder fed the same pieces, its events unsent. The request's translation lives in `responses_api`.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncllm.errors import AsyncLLMError
from asyncllm.server.chat_turn import ChatTurn, Piece, fold, start_turn
from asyncllm.server.errors import OpenAIError, engine_error
from asyncllm.server.openai_params import chat_sampling_params
from asyncllm.server.responses_api import ResponsesRequest, TextFormat, renamed, to_chat
from asyncllm.server.streaming import ClientDisconnected, SSEResponse, cancel_on_disconnect, sse_event
from asyncllm.server.streaming import disconnected_response as _gone

logger = logging.getLogger("asyncllm.server")
Event = dict[str, Any]


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    chat, origins = to_chat(body)
    try:
        params = chat_sampling_params(chat)
        turn, response_id = await start_turn(request, chat, params, "resp_")
    except OpenAIError as exc:
        raise renamed(exc, origins) from None
    except ClientDisconnected:
        return _gone()
    builder = ResponseBuilder(response_id, body)
    if body.stream:
        return SSEResponse(_streamed(turn, builder), on_close=turn.close)
    try:
        await cancel_on_disconnect(request, fold(turn, builder))
    except ClientDisconnected:
        return _gone()
    return JSONResponse(builder.response(turn))


async def _streamed(turn: ChatTurn, builder: ResponseBuilder) -> AsyncGenerator[bytes, None]:
    yield _encode(builder.opening())
    try:
        async for piece in turn.pieces():
            events = builder.feed(piece)
            if events:
                yield _encode(events)
        yield _encode(builder.finish(turn))
    except AsyncLLMError as exc:  # headers are sent: the error travels as an event
        error = engine_error(exc)
        yield _encode([builder.event("error", code=error.code or error.type, message=error.message, param=error.param)])
    except Exception:
        logger.exception("asyncllm server: /v1/responses stream failed")
        yield _encode([builder.event("error", code="server_error", message="internal server error", param=None)])


def _encode(events: list[Event]) -> bytes:
    """Each event named by its type (`event: response.created`), as OpenAI sends them."""
    return b"".join(sse_event(event["type"], event) for event in events)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponseBuilder:
    """The response's output items, built piece by piece; each step returns the events it makes."""

    def __init__(self, response_id: str, body: ResponsesRequest) -> None:
        self.body = body
        self.id = response_id
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item pieces are going to
        self.open_call: int | None = None  # the parser's index of the open function call
        self.sequence = 0
        self.usage: dict[str, Any] | None = None  # set by `finish`

    def event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def opening(self) -> list[Event]:
        head = self._object("in_progress")
        return [self.event("response.created", response=head), self.event("response.in_progress", response=head)]

    def feed(self, piece: Piece) -> list[Event]:
        events: list[Event] = []
        item = self.open
        same = item is not None and (
            (piece.kind == "text" and item["type"] == "message")
            or (piece.kind == "reasoning" and item["type"] == "reasoning")
            or (piece.kind == "call" and item["type"] == "function_call" and piece.call == self.open_call)
        )
        if not same:
            events += self._close("completed")
            events += self._open(piece)
        item = self.open
        assert item is not None
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if piece.kind == "text":
            item["content"][0]["text"] += piece.text
            events.append(
                self.event("response.output_text.delta", **where, content_index=0, delta=piece.text, logprobs=[])
            )
        elif piece.kind == "reasoning":
            item["content"][0]["text"] += piece.text
            events.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=piece.text))
        elif piece.text:
            item["arguments"] += piece.text
            events.append(self.event("response.function_call_arguments.delta", **where, delta=piece.text))
        return events

    def finish(self, turn: ChatTurn) -> list[Event]:
        cut = turn.finish_reason not in ("stop", "tool_calls")
        events = self._close("incomplete" if cut else "completed")
        self.usage = {
            "input_tokens": turn.prompt_tokens,
            "input_tokens_details": {"cached_tokens": turn.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": turn.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
        }
        final = self.response(turn)
        events.append(self.event("response.incomplete" if cut else "response.completed", response=final))
        return events

    def response(self, turn: ChatTurn) -> dict[str, Any]:
        cut = turn.finish_reason not in ("stop", "tool_calls")
        final = self._object("incomplete" if cut else "completed")
        if cut:
            reason = "max_output_tokens" if turn.finish_reason == "length" else turn.finish_reason
            final["incomplete_details"] = {"reason": reason}
        final["usage"] = self.usage
        return final

    def _object(self, status: str) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model,
            "output": copy.deepcopy(self.output) if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}
            },
            "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
            "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def _open(self, piece: Piece) -> list[Event]:
        if piece.kind == "call":
            assert piece.call_id is not None and piece.name is not None, "a call opens with its id and name"
            item: dict[str, Any] = {
                "id": _item_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": piece.call_id,
                "name": piece.name,
                "arguments": "",
            }
            self.open_call = piece.call
        elif piece.kind == "text":
            item = {
                "id": _item_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        else:
            item = {"id": _item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
        self.output.append(item)
        self.open = item
        where = {"output_index": len(self.output) - 1}
        events = [self.event("response.output_item.added", **where, item=copy.deepcopy(item))]
        if piece.kind != "call":
            part = _part(piece.kind)
            item["content"].append(part)
            events.append(
                self.event("response.content_part.added", item_id=item["id"], **where, content_index=0, part=dict(part))
            )
        return events

    def _close(self, status: str) -> list[Event]:
        item, self.open, self.open_call = self.open, None, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                done = self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            else:
                done = self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            events += [done, self.event("response.content_part.done", **where, content_index=0, part=dict(part))]
        item_done = self.event(
            "response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item)
        )
        return [*events, item_done]


def _format_json(text_format: TextFormat | None) -> dict[str, Any]:
    return {"type": "text"} if text_format is None else text_format.model_dump(by_alias=True, exclude_none=True)


def _part(kind: str) -> dict[str, Any]:
    if kind == "text":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": ""}
