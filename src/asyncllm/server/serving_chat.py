"""POST /v1/chat/completions: the response shapes of chat, streamed and not, exactly as OpenAI writes them.

Owns `chat.completion` and `chat.completion.chunk` objects: streamed, each choice opens with a delta
carrying the role, content deltas follow, an empty delta carries the finish reason, then (with
`stream_options.include_usage`) a usage chunk with no choices, then `data: [DONE]`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from asyncllm.server.generation import Submission, collect, submit
from asyncllm.server.logprobs import TokenStrings, chat_logprobs
from asyncllm.server.openai_params import chat_sampling_params
from asyncllm.server.prompts import chat_prompt
from asyncllm.server.protocol import ChatCompletionRequest
from asyncllm.server.responses import Outputs, streamed_events, whole_response
from asyncllm.server.state import server_state
from asyncllm.server.streaming import ClientDisconnected, SSEResponse, cancel_on_disconnect, sse
from asyncllm.server.streaming import disconnected_response as _gone

logger = logging.getLogger("asyncllm.server")


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    engine = state.engine_for(body.model)
    params = chat_sampling_params(body)
    prompt = chat_prompt(engine, body.messages)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    head = {"id": request_id, "created": int(time.time()), "model": state.served_model_name}
    sub = submit(engine, [prompt], params, request_id, state.metrics, prompt_param="messages")
    top_k = params[0].logprobs  # None unless logprobs were asked for
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return SSEResponse(_events(sub, head, top_k, state.token_strings, include_usage), on_close=sub.close)
    try:
        results = await cancel_on_disconnect(request, collect(sub))
    except ClientDisconnected:
        return _gone()
    choices = []
    for index, result in enumerate(results):
        logprobs = None
        if top_k is not None and result.logprobs is not None:
            logprobs = chat_logprobs(result.token_ids, result.logprobs, top_k, state.token_strings)
        message = {"role": "assistant", "content": result.text}
        choices.append(
            {"index": index, "message": message, "logprobs": logprobs, "finish_reason": result.finish_reason}
        )
    return whole_response(head, "chat.completion", choices, sub, results)


async def _events(
    sub: Submission, head: dict[str, Any], top_k: int | None, strings: TokenStrings, include_usage: bool
) -> AsyncGenerator[str, None]:
    base = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}
    if include_usage:
        base["usage"] = None

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**base, "choices": [choice]})

    async def render(outputs: Outputs) -> AsyncGenerator[str, None]:
        for index in range(len(sub.streams)):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for index, out in outputs:
            logprobs = None
            if top_k is not None and out.logprobs:
                logprobs = chat_logprobs(out.token_ids, out.logprobs, top_k, strings)
            if out.text or logprobs is not None:
                yield chunk(index, {"content": out.text}, logprobs)
            if out.finish_reason is not None:
                yield chunk(index, {}, finish_reason=out.finish_reason)

    async for event in streamed_events(sub, base, include_usage, "chat", render):
        yield event
