"""One chat turn for the APIs beside chat completions (OpenAI Responses, Anthropic Messages): their request,
already translated into a `ChatCompletionRequest`, planned and submitted exactly as chat's is
(`plan_chat_request`, `generation.submit`), then read back as `Piece`s: reasoning, answer text and tool-call
pieces, in the order the model wrote them, from one stream of engine outputs through the chat parsers.

Owns what both APIs need and chat does not: answer text that is only whitespace beside tool calls is no
answer (held until text follows; dropped before a call, or at the end of a reply that called tools), and
which stop sequence ended the reply.
Knows nothing of either API's shapes or errors.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from starlette.requests import Request

from asyncllm import SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.parsing import ChatChunk, ChatFinishReason, ChatStreamParser
from asyncllm.server.chat_request import plan_chat_request
from asyncllm.server.errors import invalid_request
from asyncllm.server.generation import MergedOutputs, Submission, first_read, submit
from asyncllm.server.openai_params import chat_renames
from asyncllm.server.protocol import ChatCompletionRequest
from asyncllm.server.state import server_state
from asyncllm.server.streaming import cancel_on_disconnect

PieceKind = Literal["reasoning", "text", "call"]


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of the reply: reasoning or answer `text`, or a piece of call `call`'s arguments (its first
    piece carries its `call_id` and `name`, with arguments possibly empty)."""

    kind: PieceKind
    text: str
    call: int = 0
    call_id: str | None = None
    name: str | None = None


@dataclass
class ChatTurn:
    """A submitted turn: iterate `pieces()` once; then `finish_reason`, `stop_sequence` and the token counts
    are set. `close()` aborts what still runs (idempotent)."""

    sub: Submission
    outputs: MergedOutputs
    parser: ChatStreamParser
    stops: tuple[str, ...]  # the request's stop strings, kept in the output to say which one matched
    finish_reason: ChatFinishReason | None = None
    stop_sequence: str | None = None
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # tokens of outputs that held reasoning only

    @property
    def prompt_tokens(self) -> int:
        return self.sub.num_prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.sub.num_cached_tokens

    def close(self) -> None:
        self.sub.close()

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        held = ""  # whitespace-only answer text, not yet known to be an answer
        called = False
        try:
            async for _, out in self.outputs:
                self.completion_tokens += len(out.token_ids)
                text = out.text
                if out.finish_reason == "stop" and self.stops:  # kept in the output (see `start_turn`)
                    self.stop_sequence = max((s for s in self.stops if text.endswith(s)), key=len, default=None)
                    if self.stop_sequence is not None:
                        text = text[: len(text) - len(self.stop_sequence)]
                chunk = self.parser.read(text, out.finish_reason)
                if chunk.reasoning_text and not chunk.text and not chunk.tool_calls:
                    self.reasoning_tokens += len(out.token_ids)
                for piece in _pieces(chunk):
                    if piece.kind == "text" and not (held + piece.text).strip():
                        held += piece.text
                        continue
                    if piece.kind == "text" and held:
                        piece = Piece("text", held + piece.text)
                    if piece.kind != "reasoning":
                        held = ""
                    called = called or piece.kind == "call"
                    yield piece
                if chunk.finish_reason is not None:
                    self.finish_reason = chunk.finish_reason
            if held and not called:  # a reply of whitespace alone, with no call beside it, is the answer
                yield Piece("text", held)
        finally:
            await self.outputs.aclose()


class Builder(Protocol):
    """An API's response built from a turn's pieces (`serving_responses.py`, `serving_messages.py`)."""

    def feed(self, piece: Piece) -> list[Any]: ...

    def finish(self, turn: ChatTurn) -> list[Any]: ...


async def fold(turn: ChatTurn, builder: Builder) -> None:
    """Feed every piece of `turn` to `builder`, then finish it: the non-streamed response is the streamed
    one's final state (its events are dropped here)."""
    async for piece in turn.pieces():
        builder.feed(piece)
    builder.finish(turn)


def _pieces(chunk: ChatChunk) -> list[Piece]:
    pieces = []
    if chunk.reasoning_text:
        pieces.append(Piece("reasoning", chunk.reasoning_text))
    if chunk.text:
        pieces.append(Piece("text", chunk.text))
    for call in chunk.tool_calls:
        if call.id is not None or call.arguments:
            pieces.append(Piece("call", call.arguments, call.index, call.id, call.name))
    return pieces


async def start_turn(
    request: Request, body: ChatCompletionRequest, params: SamplingParams, id_prefix: str
) -> tuple[ChatTurn, str]:
    """Plan and submit `body` (its samples: one), its first output read so that a refusal the engine makes
    off the loop is still a 400 (`OpenAIError`, chat's field names: the caller renames them). Returns the
    turn and its request id (`id_prefix` + 32 hex digits). Raises `ClientDisconnected` if the client left."""
    state = server_state(request)
    engine, lora = state.resolve(body.model)
    timeout = state.timeout_for(body.timeout)
    stops = params.stop_strings
    if stops and not params.include_stop_str_in_output:  # kept, to tell which one matched; cut off in `pieces`
        params = dataclasses.replace(params, include_stop_str_in_output=True)
    plan = await plan_chat_request(engine, body, params, state.chat_template)
    request_id = f"{id_prefix}{secrets.token_hex(16)}"
    sub = submit(
        engine, [plan.prompt_token_ids], [plan.constrain(params)], request_id, state.metrics, "messages",
        body.priority or 0, lora, timeout,
    )  # fmt: skip
    try:
        outputs = await cancel_on_disconnect(request, first_read(sub))
    except InvalidRequestError as exc:  # a constraint that does not compile names itself, in chat's words
        raise invalid_request(exc, param="messages", renames=chat_renames(body)) from None
    return ChatTurn(sub, outputs, plan.parser(), stops), request_id
