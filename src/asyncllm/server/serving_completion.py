"""POST /v1/completions: the `text_completion` shapes, streamed and not, as OpenAI writes them.

Owns completion choices (prompt i, sample j is choice i * n + j; each prompt's n samples are one engine
request, `SamplingParams.n`), their logprobs' running text offsets,
and the streamed chunks: text as it comes (with `echo`, each choice's first chunk opens with its prompt:
`echo.py`), the finish reason on each choice's last chunk, an optional usage chunk with no choices, then
`data: [DONE]`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from asyncllm.outputs import StreamOutput
from asyncllm.server.echo import Echo, without_completions
from asyncllm.server.generation import Submission, collect, merged, submit
from asyncllm.server.logprobs import TokenStrings, completion_logprobs, join_logprobs
from asyncllm.server.openai_params import completion_sampling_params, echoes_prompt_only
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
    engine, lora = state.resolve(body.model)
    params = completion_sampling_params(body)
    timeout = state.timeout_for(body.timeout)
    prompts = completion_prompts(body)
    request_id = f"cmpl-{secrets.token_hex(16)}"  # 32 hex digits, as uuid4().hex (a fifth the cost)
    head = {"id": request_id, "created": int(time.time()), "model": body.model}
    sub = submit(engine, prompts, [params], request_id, state.metrics, "prompt", body.priority or 0, lora, timeout)
    top_k = body.logprobs
    echo = None
    if body.echo:
        echo = Echo(prompts, sub, top_k, state.token_strings, engine.tokenizer, echoes_prompt_only(body))
    if body.stream:
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        events = _events(sub, head, top_k, state.token_strings, include_usage, echo)
        return SSEResponse(events, on_close=sub.close)
    try:
        results = await cancel_on_disconnect(request, collect(sub))
    except ClientDisconnected:
        return _gone()
    if echo is not None:
        for index, result in enumerate(results):
            echo.note(index, result.prompt_logprobs)
        if echo.prompt_only:
            results = [echo.without_completion(result) for result in results]
    choices = []
    for index, result in enumerate(results):
        text, logprobs = "", None
        if echo is not None:
            text, logprobs = echo.prefix(index)
        if top_k is not None and result.logprobs is not None:
            mine = completion_logprobs(result.token_ids, result.logprobs, top_k, state.token_strings, len(text))
            logprobs = join_logprobs(logprobs, mine)
        text += result.text
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason})
    return whole_response(head, "text_completion", choices, sub, results)


def _events(
    sub: Submission,
    head: dict[str, Any],
    top_k: int | None,
    strings: TokenStrings,
    include_usage: bool,
    echo: Echo | None,
) -> AsyncGenerator[bytes, None]:
    base = {**head, "object": "text_completion", "system_fingerprint": None}
    if include_usage:
        base["usage"] = None
    frames = ChunkFrames(base)
    offsets = [0] * sub.num_choices  # characters of each choice sent so far, for logprobs' text_offset
    echoed = [False] * sub.num_choices

    def render(index: int, out: StreamOutput) -> bytes:
        text, logprobs = "", None
        if echo is not None and not echoed[index]:  # the choice's first chunk: its prompt first
            echoed[index] = True
            echo.note(index, out.prompt_logprobs)  # the request's first chunk brings them
            text, logprobs = echo.prefix(index)
            offsets[index] += len(text)
        if top_k is not None and out.logprobs:
            mine = completion_logprobs(out.token_ids, out.logprobs, top_k, strings, offsets[index])
            logprobs = join_logprobs(logprobs, mine)
        offsets[index] += len(out.text)
        text += out.text
        reason = out.finish_reason
        if logprobs is None and reason is None:  # a token's text, the chunk nearly every event is
            return frames.frame_json(_TEXT_CHOICE % (index, encode_str(text))) if text else b""
        return frames.frame({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})

    outputs = without_completions(merged(sub)) if echo is not None and echo.prompt_only else None
    return streamed_events(sub, base, include_usage, "completion", render, outputs)
