"""POST /v1/completions: the `text_completion` shapes, streamed and not, as OpenAI writes them.

Owns completion choices (prompt i, sample j is choice i * n + j; each prompt's n samples are one engine
request, `SamplingParams.n`), their logprobs' running text offsets,
and the streamed chunks: text as it comes (with `echo`, each choice's first chunk opens with its prompt:
`echo.py`), the finish reason on each choice's last chunk, an optional usage chunk with no choices, then
`data: [DONE]`.
"""

from __future__ import annotations

import bisect
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import OutputAccumulator, StreamOutput
from asyncllm.server.echo import Echo, without_completions
from asyncllm.server.errors import invalid_request
from asyncllm.server.generation import Submission, collect, merged, submit
from asyncllm.server.logprobs import TokenStrings, completion_logprobs, join_logprobs
from asyncllm.server.openai_params import completion_renames, completion_sampling_params, echoes_prompt_only
from asyncllm.server.prompts import completion_prompts
from asyncllm.server.protocol import CompletionRequest
from asyncllm.server.responses import streamed_events, whole_response
from asyncllm.server.state import server_state
from asyncllm.server.streaming import ChunkFrames, ClientDisconnected, SSEResponse, cancel_on_disconnect, encode_str
from asyncllm.server.streaming import disconnected_response as _gone
from asyncllm.server.vllm_extras import check_truncation, prompt_logprobs_json, truncated_prompts

logger = logging.getLogger("asyncllm.server")
# A choice with text only, as `ChunkFrames.frame` would encode it: a streamed token's chunk, built per token.
_TEXT_CHOICE = '{"index":%d,"text":%s,"logprobs":null,"finish_reason":null}'


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    engine, lora = state.resolve(body.model)
    params = completion_sampling_params(body)
    timeout = state.timeout_for(body.timeout)
    check_truncation(body.truncate_prompt_tokens)
    prompts = completion_prompts(body)
    if body.truncate_prompt_tokens is not None:
        keep, limit = body.truncate_prompt_tokens, engine.runtime.max_seq_len
        prompts = await truncated_prompts(prompts, keep, engine.tokenizer, limit)
    request_id = f"cmpl-{secrets.token_hex(16)}"  # 32 hex digits, as uuid4().hex (a fifth the cost)
    head = {"id": request_id, "created": int(time.time()), "model": body.model}
    sub = submit(engine, prompts, [params], request_id, state.metrics, "prompt", body.priority or 0, lora, timeout)
    top_k = body.logprobs
    echo = None
    if body.echo:
        echo = Echo(prompts, sub, top_k, state.token_strings, engine.tokenizer, echoes_prompt_only(body))
    with_ids = bool(body.return_token_ids)
    if body.stream:
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
        events = _events(sub, head, top_k, state.token_strings, include_usage, echo, continuous, with_ids)
        return SSEResponse(events, on_close=sub.close)
    try:
        results = await cancel_on_disconnect(request, collect(sub))
    except ClientDisconnected:
        return _gone()
    except InvalidRequestError as exc:  # refused once tokenized or compiled: named as the request names it
        raise invalid_request(exc, param="prompt", renames=completion_renames(body)) from None
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
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}
        prompt_ids = _prompt_ids(sub, index)
        if body.prompt_logprobs is not None:
            scored = _prompt_scores(sub, results, index)
            choice["prompt_logprobs"] = (
                None
                if scored is None
                else prompt_logprobs_json(prompt_ids, scored, body.prompt_logprobs, state.token_strings)
            )
        if with_ids:
            choice |= {"prompt_token_ids": prompt_ids, "token_ids": result.token_ids}
        choices.append(choice)
    return whole_response(head, "text_completion", choices, sub, results)


def _prompt_ids(sub: Submission, choice: int) -> list[int]:
    return list(sub.streams[bisect.bisect_right(sub.first_choice, choice) - 1].prompt_token_ids or ())


def _prompt_scores(sub: Submission, results: list[OutputAccumulator], choice: int) -> Any:
    """The prompt's logprobs of `choice`'s engine request: whichever of its samples brought them."""
    k = bisect.bisect_right(sub.first_choice, choice) - 1
    end = sub.first_choice[k + 1] if k + 1 < len(sub.first_choice) else len(results)
    return next((r.prompt_logprobs for r in results[sub.first_choice[k] : end] if r.prompt_logprobs is not None), None)


def _events(
    sub: Submission,
    head: dict[str, Any],
    top_k: int | None,
    strings: TokenStrings,
    include_usage: bool,
    echo: Echo | None,
    continuous: bool,
    with_ids: bool,
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
        if with_ids:  # vLLM's: each chunk's token ids, and a choice's first chunk its prompt's
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            if not started[index]:
                started[index] = True
                choice["prompt_token_ids"] = _prompt_ids(sub, index)
            return frames.frame(choice | {"token_ids": list(out.token_ids)})
        if logprobs is None and reason is None:  # a token's text, the chunk nearly every event is
            return frames.frame_json(_TEXT_CHOICE % (index, encode_str(text))) if text else b""
        return frames.frame({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})

    started = [False] * sub.num_choices
    outputs = without_completions(merged(sub)) if echo is not None and echo.prompt_only else None
    return streamed_events(
        sub, base, include_usage, "completion", render, outputs, continuous=frames if continuous else None
    )
