"""POST /v1/chat/completions: the response shapes of chat, streamed and not, exactly as OpenAI writes them.

Owns `chat.completion` and `chat.completion.chunk` objects. The conversation is planned once as
`engine.chat` plans it (`chat_request`); its `n` samples run as one engine request (`generation.submit`,
`SamplingParams.n`: the prompt prefilled once, its blocks shared) and each choice's text goes through a
parser of its own, which splits reasoning off and reads tool calls. Streamed, each choice opens with a
delta carrying the role, reasoning, content and tool-call deltas follow (`chat_reply`), an empty delta
carries the finish reason, then (with `stream_options.include_usage`) a usage chunk with no choices, then
`data: [DONE]`. vLLM's extras (`vllm_extras`): `prompt_logprobs` and, with `return_token_ids`, the prompt's
and each choice's token ids beside OpenAI's fields; `truncate_prompt_tokens` cuts the templated prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import StreamOutput
from asyncllm.parsing import ChatStreamParser
from asyncllm.server.chat_reply import chunk_deltas, whole_message
from asyncllm.server.chat_request import plan_chat_request
from asyncllm.server.errors import invalid_request
from asyncllm.server.generation import MergedOutputs, Submission, collect, first_read, submit
from asyncllm.server.logprobs import TokenStrings, chat_logprobs
from asyncllm.server.openai_params import chat_renames, chat_sampling_params
from asyncllm.server.protocol import ChatCompletionRequest
from asyncllm.server.responses import streamed_events, whole_response
from asyncllm.server.state import server_state
from asyncllm.server.streaming import (
    ChunkFrames,
    ClientDisconnected,
    SSEResponse,
    cancel_on_disconnect,
    encode_str,
    sse,
)
from asyncllm.server.streaming import disconnected_response as _gone
from asyncllm.server.vllm_extras import check_truncation, prompt_logprobs_json, truncated

logger = logging.getLogger("asyncllm.server")
# A choice whose delta is content only, as `ChunkFrames.frame` would encode it: a streamed token's chunk.
_CONTENT_CHOICE = '{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}'


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    engine, lora = state.resolve(body.model)
    params = chat_sampling_params(body)
    timeout = state.timeout_for(body.timeout)
    check_truncation(body.truncate_prompt_tokens)
    # The chat planning refuses prompt_logprobs (`engine.chat`'s chunks carry the reply only); here the
    # response carries them: planned without, submitted with.
    planned = params if params.prompt_logprobs is None else dataclasses.replace(params, prompt_logprobs=None)
    plan = await plan_chat_request(engine, body, planned, state.chat_template)
    request_id = f"chatcmpl-{secrets.token_hex(16)}"  # 32 hex digits, as uuid4().hex (a fifth the cost)
    head = {"id": request_id, "created": int(time.time()), "model": body.model}
    prompt_ids = truncated(plan.prompt_token_ids, body.truncate_prompt_tokens, engine.runtime.max_seq_len)
    prompts, constrained = [prompt_ids], [plan.constrain(params)]
    sub = submit(engine, prompts, constrained, request_id, state.metrics, "messages", body.priority or 0, lora, timeout)
    parsers = [plan.parser() for _ in range(sub.num_choices)]  # choice i's: OpenAI's choice index is the sample's
    top_k = params.logprobs  # None unless logprobs were asked for
    renames = chat_renames(body)
    with_ids = bool(body.return_token_ids)
    if body.stream:
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
        try:  # a request refused once compiled or tokenized is a 400 still, not an event after a 200
            outputs = await cancel_on_disconnect(request, first_read(sub))
        except ClientDisconnected:
            return _gone()
        except InvalidRequestError as exc:
            raise invalid_request(exc, param="messages", renames=renames) from None
        opening_ids = prompt_ids if with_ids else None
        events = _events(
            sub, outputs, head, parsers, top_k, state.token_strings, include_usage, continuous, opening_ids
        )
        return SSEResponse(events, on_close=sub.close)
    try:
        results = await cancel_on_disconnect(request, collect(sub))
    except ClientDisconnected:
        return _gone()
    except InvalidRequestError as exc:
        raise invalid_request(exc, param="messages", renames=renames) from None
    choices = []
    for index, (result, parser) in enumerate(zip(results, parsers)):
        logprobs = None
        if top_k is not None and result.logprobs is not None:
            logprobs = chat_logprobs(result.token_ids, result.logprobs, top_k, state.token_strings)
        assert result.finish_reason is not None
        reply = parser.read(result.text, result.finish_reason)
        message = whole_message(reply.text, reply.reasoning_text, parser.tool_calls)
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reply.finish_reason}
        if with_ids:
            choice["token_ids"] = result.token_ids
        choices.append(choice)
    extra: dict[str, Any] = {}
    if params.prompt_logprobs is not None:
        scored = next((r.prompt_logprobs for r in results if r.prompt_logprobs is not None), None)
        if scored is not None:
            k, strings = params.prompt_logprobs, state.token_strings
            extra["prompt_logprobs"] = prompt_logprobs_json(prompt_ids, scored, k, strings)
    if with_ids:
        extra["prompt_token_ids"] = prompt_ids
    return whole_response(head, "chat.completion", choices, sub, results, extra)


def _events(
    sub: Submission,
    outputs: MergedOutputs,
    head: dict[str, Any],
    parsers: list[ChatStreamParser],
    top_k: int | None,
    strings: TokenStrings,
    include_usage: bool,
    continuous: bool,
    prompt_ids: list[int] | None,
) -> AsyncGenerator[bytes, None]:
    """`prompt_ids`: given with `return_token_ids` (the first chunk carries them, every choice its tokens)."""
    base = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}
    if include_usage:
        base["usage"] = None
    frames = ChunkFrames(base)
    with_ids = prompt_ids is not None

    def chunk(
        index: int,
        delta: dict[str, Any],
        logprobs: Any = None,
        finish_reason: str | None = None,
        token_ids: Any = None,
    ) -> bytes:
        if token_ids is None and logprobs is None and finish_reason is None and len(delta) == 1 and "content" in delta:
            return frames.frame_json(_CONTENT_CHOICE % (index, encode_str(delta["content"])))
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return frames.frame(choice)

    def render(index: int, out: StreamOutput) -> bytes:
        logprobs = None
        if top_k is not None and out.logprobs:
            logprobs = chat_logprobs(out.token_ids, out.logprobs, top_k, strings)
        parsed = parsers[index].read(out.text, out.finish_reason)
        deltas = chunk_deltas(parsed)
        if (logprobs is not None or (with_ids and out.token_ids)) and not deltas:  # the parser holds the text
            deltas = [{}]  # back; the tokens go now
        ids = list(out.token_ids) if with_ids else None
        parts = [
            chunk(index, delta, logprobs if i == 0 else None, token_ids=ids if i == 0 else ([] if with_ids else None))
            for i, delta in enumerate(deltas)
        ]
        if parsed.finish_reason is not None:
            parts.append(chunk(index, {}, finish_reason=parsed.finish_reason, token_ids=[] if with_ids else None))
        return b"".join(parts)

    def opening() -> bytes:
        if with_ids:  # the first chunk carries the prompt's ids, as vLLM's does
            first = {**frames.base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            first["choices"][0] |= {"logprobs": None, "finish_reason": None, "token_ids": []}
            rest = (chunk(i, {"role": "assistant", "content": ""}, token_ids=[]) for i in range(1, sub.num_choices))
            return sse({**first, "prompt_token_ids": prompt_ids}) + b"".join(rest)
        return b"".join(chunk(index, {"role": "assistant", "content": ""}) for index in range(sub.num_choices))

    return streamed_events(sub, base, include_usage, "chat", render, outputs, opening, frames if continuous else None)
