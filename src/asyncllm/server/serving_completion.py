"""POST /v1/completions: the `text_completion` shapes, streamed and not, as OpenAI writes them.

Owns completion choices (prompt i, sample j is choice i * n + j), their logprobs' running text offsets,
and the streamed chunks: text as it comes, the finish reason on each choice's last chunk, an optional
usage chunk with no choices, then `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from asyncllm.errors import EngineDeadError
from asyncllm.server.errors import OpenAIError, engine_dead
from asyncllm.server.generation import Submission, collect, merged, submit, usage
from asyncllm.server.logprobs import TokenStrings, completion_logprobs
from asyncllm.server.openai_params import completion_sampling_params
from asyncllm.server.prompts import completion_prompts
from asyncllm.server.protocol import CompletionRequest
from asyncllm.server.state import server_state
from asyncllm.server.streaming import DONE, ClientDisconnected, SSEResponse, cancel_on_disconnect, sse
from asyncllm.server.streaming import disconnected_response as _gone

logger = logging.getLogger("asyncllm.server")


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    engine = state.engine_for(body.model)
    params = completion_sampling_params(body)
    prompts = completion_prompts(body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    head = {"id": request_id, "created": int(time.time()), "model": state.served_model_name}
    sub = submit(engine, prompts, params, request_id, state.metrics, prompt_param="prompt")
    top_k = body.logprobs
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
            logprobs = completion_logprobs(result.token_ids, result.logprobs, top_k, state.token_strings, 0)
        choices.append(
            {"index": index, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}
        )
    completion_tokens = sum(len(r.token_ids) for r in results)
    return JSONResponse(
        {
            **head,
            "object": "text_completion",
            "choices": choices,
            "usage": usage(sub.num_prompt_tokens, completion_tokens),
            "system_fingerprint": None,
        }
    )


async def _events(
    sub: Submission, head: dict[str, Any], top_k: int | None, strings: TokenStrings, include_usage: bool
) -> AsyncGenerator[str, None]:
    base = {**head, "object": "text_completion", "system_fingerprint": None}
    if include_usage:
        base["usage"] = None
    offsets = [0] * len(sub.streams)  # characters of each choice sent so far, for logprobs' text_offset
    completion_tokens = 0
    try:
        async with contextlib.aclosing(merged(sub)) as outputs:
            async for index, out in outputs:
                completion_tokens += len(out.token_ids)
                logprobs = None
                if top_k is not None and out.logprobs:
                    logprobs = completion_logprobs(out.token_ids, out.logprobs, top_k, strings, offsets[index])
                offsets[index] += len(out.text)
                if out.text or logprobs is not None or out.finish_reason is not None:
                    choice = {
                        "index": index,
                        "text": out.text,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason,
                    }
                    yield sse({**base, "choices": [choice]})
    except EngineDeadError as exc:  # headers are sent: the error travels as an event, as OpenAI does
        yield sse(engine_dead(exc).body())
        return
    except Exception:
        logger.exception("asyncllm server: completion stream failed")
        yield sse(OpenAIError("internal server error", status=500, type="server_error").body())
        return
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(sub.num_prompt_tokens, completion_tokens)})
    yield DONE
