"""POST /v1/completions: the `text_completion` shapes, streamed and not, as OpenAI writes them.

Owns completion choices (prompt i, sample j is choice i * n + j; each prompt's n samples are one engine
request, `SamplingParams.n`), their logprobs' running text offsets,
and the streamed chunks: text as it comes, the finish reason on each choice's last chunk, an optional
usage chunk with no choices, then `data: [DONE]`.
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
from asyncllm.server.logprobs import TokenStrings, completion_logprobs
from asyncllm.server.openai_params import completion_sampling_params
from asyncllm.server.prompts import completion_prompts
from asyncllm.server.protocol import CompletionRequest
from asyncllm.server.responses import Outputs, streamed_events, whole_response
from asyncllm.server.state import server_state
from asyncllm.server.streaming import ClientDisconnected, SSEResponse, cancel_on_disconnect, sse
from asyncllm.server.streaming import disconnected_response as _gone

logger = logging.getLogger("asyncllm.server")


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    engine, lora = state.resolve(body.model)
    params = completion_sampling_params(body)
    prompts = completion_prompts(body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    head = {"id": request_id, "created": int(time.time()), "model": body.model}
    sub = submit(engine, prompts, [params], request_id, state.metrics, prompt_param="prompt", lora=lora)
    top_k = body.logprobs
    if body.stream:
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        return SSEResponse(_events(sub, head, top_k, state.token_strings, include_usage), on_close=sub.close)
    try:
        results = await cancel_on_disconnect(request, collect(sub))
    except ClientDisconnected:
        return _gone()
    choices = []
    for index, result in enumerate(results):
        logprobs = None
        if top_k is not None and result.logprobs is not None:
            logprobs = completion_logprobs(result.token_ids, result.logprobs, top_k, state.token_strings, 0)
        choices.append(
            {"index": index, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}
        )
    return whole_response(head, "text_completion", choices, sub, results)


async def _events(
    sub: Submission, head: dict[str, Any], top_k: int | None, strings: TokenStrings, include_usage: bool
) -> AsyncGenerator[str, None]:
    base = {**head, "object": "text_completion", "system_fingerprint": None}
    if include_usage:
        base["usage"] = None
    offsets = [0] * sub.num_choices  # characters of each choice sent so far, for logprobs' text_offset

    async def render(outputs: Outputs) -> AsyncGenerator[str, None]:
        async for index, out in outputs:
            logprobs = None
            if top_k is not None and out.logprobs:
                logprobs = completion_logprobs(out.token_ids, out.logprobs, top_k, strings, offsets[index])
            offsets[index] += len(out.text)
            if out.text or logprobs is not None or out.finish_reason is not None:
                choice = {"index": index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}
                yield sse({**base, "choices": [choice]})

    async for event in streamed_events(sub, base, include_usage, "completion", render):
        yield event
