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

from asyncllm.outputs import StreamOutput
from asyncllm.server.generation import Submission, collect, submit
from asyncllm.server.logprobs import TokenStrings, completion_logprobs
from asyncllm.server.openai_params import completion_sampling_params
from asyncllm.server.prompts import completion_prompts
from asyncllm.server.protocol import CompletionRequest
from asyncllm.server.responses import streamed_events, whole_response
from asyncllm.server.state import server_state
from asyncllm.server.streaming import ChunkFrames, ClientDisconnected, SSEResponse, cancel_on_disconnect, encode_str
from asyncllm.server.streaming import disconnected_response as _gone

logger = logging.getLogger("asyncllm.server")
# A choice with text only, as `ChunkFrames.frame` would encode it: a streamed token's chunk, built per token.
_TEXT_CHOICE = '{"index":%d,"text":%s,"logprobs":null,"finish_reason":null}'


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    engine = state.engine_for(body.model)
    params = completion_sampling_params(body)
    prompts = completion_prompts(body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    head = {"id": request_id, "created": int(time.time()), "model": state.served_model_name}
    sub = submit(engine, prompts, [params], request_id, state.metrics, "prompt", body.priority or 0)
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


def _events(
    sub: Submission, head: dict[str, Any], top_k: int | None, strings: TokenStrings, include_usage: bool
) -> AsyncGenerator[bytes, None]:
    base = {**head, "object": "text_completion", "system_fingerprint": None}
    if include_usage:
        base["usage"] = None
    frames = ChunkFrames(base)
    offsets = [0] * sub.num_choices  # characters of each choice sent so far, for logprobs' text_offset

    def render(index: int, out: StreamOutput) -> bytes:
        text, reason = out.text, out.finish_reason
        logprobs = None
        if top_k is not None and out.logprobs:
            logprobs = completion_logprobs(out.token_ids, out.logprobs, top_k, strings, offsets[index])
        offsets[index] += len(text)
        if logprobs is None and reason is None:  # a token's text, the chunk nearly every event is
            if not text:
                return b""
            return frames.frame_json(_TEXT_CHOICE % (index, encode_str(text)))
        return frames.frame({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})

    return streamed_events(sub, base, include_usage, "completion", render)
