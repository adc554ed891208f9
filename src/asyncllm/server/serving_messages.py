"""POST /v1/messages: a chat turn (`chat_turn`) answered in the shapes of Anthropic's Messages API.

Owns the `message` object and its stream, as the anthropic package's `types` spell them: `message_start`,
then per content block (thinking, text, tool_use, in the order the model wrote them) `content_block_start`,
its `content_block_delta`s (`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`;
last `message_delta` (stop_reason, stop_sequence, usage) and `message_stop`. The whole (non-streamed) message
is the same builder fed the same pieces. Every error, a body that does not validate included, takes
Anthropic's shape (`messages_api.error_response`); the translation lives in `messages_api`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncllm.errors import AsyncLLMError
from asyncllm.server.chat_turn import ChatTurn, Piece, fold, start_turn
from asyncllm.server.errors import OpenAIError, engine_error
from asyncllm.server.json_body import read_body_bytes
from asyncllm.server.json_route import body_limit, read_body
from asyncllm.server.messages_api import MessagesRequest, error_body, error_response, renamed, to_chat
from asyncllm.server.openai_params import chat_sampling_params
from asyncllm.server.streaming import ClientDisconnected, SSEResponse, cancel_on_disconnect, sse_event
from asyncllm.server.streaming import disconnected_response as _gone

logger = logging.getLogger("asyncllm.server")
Event = dict[str, Any]
# The chat parsers' finish reason -> Anthropic's stop_reason (a timeout, like the token limit, cut the reply).
_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "timeout": "max_tokens"}


def messages_route(path: str = "/v1/messages") -> Route:
    """POST `path`, every failure answered in Anthropic's error shape."""

    async def endpoint(request: Request) -> Response:
        try:
            raw = await read_body_bytes(request, body_limit(request))  # past the bound: a 413, unread
        except ClientDisconnect:
            return _gone()
        except OpenAIError as exc:
            return error_response(exc)
        try:
            body = await read_body(MessagesRequest, raw, request.headers.get("content-type"))
            return await create_message(body, request)
        except OpenAIError as exc:
            return error_response(exc)
        except AsyncLLMError as exc:
            return error_response(engine_error(exc))

    return Route(path, endpoint, methods=["POST"], include_in_schema=False)


async def create_message(body: MessagesRequest, request: Request) -> Response:
    chat, origins = to_chat(body)
    try:
        params = chat_sampling_params(chat)
        turn, message_id = await start_turn(request, chat, params, "msg_")
    except OpenAIError as exc:
        raise renamed(exc, origins) from None
    except ClientDisconnected:
        return _gone()
    builder = MessageBuilder(message_id, body.model)
    if body.stream:
        return SSEResponse(_streamed(turn, builder), on_close=turn.close)
    try:
        await cancel_on_disconnect(request, fold(turn, builder))
    except ClientDisconnected:
        return _gone()
    return JSONResponse(builder.message(turn))


async def _streamed(turn: ChatTurn, builder: MessageBuilder) -> AsyncGenerator[bytes, None]:
    yield _encode([builder.opening(turn)])
    try:
        async for piece in turn.pieces():
            yield _encode(builder.feed(piece))
        yield _encode(builder.finish(turn))
    except AsyncLLMError as exc:  # headers are sent: the error travels as an event, as Anthropic sends it
        yield _encode([error_body(engine_error(exc))])
    except Exception:
        logger.exception("asyncllm server: /v1/messages stream failed")
        yield _encode([{"type": "error", "error": {"type": "api_error", "message": "internal server error"}}])


def _encode(events: list[Event]) -> bytes:
    """Each event named by its type (`event: message_start`): the anthropic client reads the name."""
    return b"".join(sse_event(event["type"], event) for event in events)


class MessageBuilder:
    """The message's content blocks, built piece by piece; each step returns the events it makes."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model
        self.blocks: list[dict[str, Any]] = []
        self.arguments: list[str] = []  # each block's input JSON text (tool_use blocks; "" for others)
        self.open: int | None = None  # the block pieces are going to
        self.open_call: int | None = None  # the parser's index of the open call
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def opening(self, turn: ChatTurn) -> Event:
        head = {**self._object(), "content": [], "usage": {**self._usage(turn), "output_tokens": 0}}
        return {"type": "message_start", "message": head}

    def feed(self, piece: Piece) -> list[Event]:
        events: list[Event] = []
        block = self.blocks[self.open] if self.open is not None else None
        same = block is not None and (
            (piece.kind == "text" and block["type"] == "text")
            or (piece.kind == "reasoning" and block["type"] == "thinking")
            or (piece.kind == "call" and block["type"] == "tool_use" and piece.call == self.open_call)
        )
        if not same:
            events += self._close()
            events.append(self._start(piece))
        index = self.open
        assert index is not None
        block = self.blocks[index]
        if piece.kind == "text":
            block["text"] += piece.text
            delta = {"type": "text_delta", "text": piece.text}
        elif piece.kind == "reasoning":
            block["thinking"] += piece.text
            delta = {"type": "thinking_delta", "thinking": piece.text}
        elif piece.text:
            self.arguments[index] += piece.text
            delta = {"type": "input_json_delta", "partial_json": piece.text}
        else:
            return events
        return [*events, {"type": "content_block_delta", "index": index, "delta": delta}]

    def finish(self, turn: ChatTurn) -> list[Event]:
        events = self._close()
        reason = turn.finish_reason or "stop"
        self.stop_reason = _STOP_REASONS.get(reason, "end_turn")
        if turn.stop_sequence is not None:
            self.stop_reason, self.stop_sequence = "stop_sequence", turn.stop_sequence
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        events.append({"type": "message_delta", "delta": delta, "usage": self._usage(turn)})
        events.append({"type": "message_stop"})
        return events

    def message(self, turn: ChatTurn) -> dict[str, Any]:
        content = []
        for block, arguments in zip(self.blocks, self.arguments):
            if block["type"] == "tool_use":
                try:
                    block = {**block, "input": json.loads(arguments or "{}")}
                except ValueError:  # a call cut off by max_tokens: its input is no JSON object yet
                    continue
            content.append(block)
        return {**self._object(), "content": content, "usage": self._usage(turn)}

    def _object(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
        }

    @staticmethod
    def _usage(turn: ChatTurn) -> dict[str, Any]:
        """Anthropic counts prompt tokens the cache served apart from `input_tokens`."""
        cached = turn.cached_tokens
        return {
            "input_tokens": turn.prompt_tokens - cached,
            "output_tokens": turn.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _start(self, piece: Piece) -> Event:
        if piece.kind == "call":
            assert piece.call_id is not None and piece.name is not None, "a call opens with its id and name"
            call_id = "toolu_" + piece.call_id.removeprefix("call_")
            block: dict[str, Any] = {"type": "tool_use", "id": call_id, "name": piece.name, "input": {}}
            self.open_call = piece.call
        elif piece.kind == "text":
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        self.blocks.append(block)
        self.arguments.append("")
        self.open = len(self.blocks) - 1
        return {"type": "content_block_start", "index": self.open, "content_block": dict(block)}

    def _close(self) -> list[Event]:
        index, self.open, self.open_call = self.open, None, None
        return [] if index is None else [{"type": "content_block_stop", "index": index}]
