"""What the chat and completion endpoints share around their own choice shapes: the whole (non-streamed)
response object, and the frame of a streamed one (each endpoint's events, then the usage chunk when asked
and `data: [DONE]`; a failure after the headers went out travels as an error event, as OpenAI sends it).
With vLLM's `stream_options.continuous_usage_stats` every chunk carries the usage so far."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import JSONResponse

from asyncllm.errors import AsyncLLMError
from asyncllm.outputs import OutputAccumulator, StreamOutput
from asyncllm.server.errors import OpenAIError, engine_error
from asyncllm.server.generation import MergedOutputs, Submission, merged
from asyncllm.server.streaming import DONE, ChunkFrames, sse

logger = logging.getLogger("asyncllm.server")

Render = Callable[[int, StreamOutput], bytes]  # (choice index, its next output) -> the SSE frames it sends


def whole_response(
    head: dict[str, Any],
    object_name: str,
    choices: list[dict[str, Any]],
    sub: Submission,
    results: list[OutputAccumulator],
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    """`extra`: top-level fields after OpenAI's (vLLM's `prompt_logprobs`, `prompt_token_ids`)."""
    completion_tokens = sum(len(r.token_ids) for r in results)
    body = {
        **head,
        "object": object_name,
        "choices": choices,
        "usage": sub.usage(completion_tokens),
        "system_fingerprint": None,
        **(extra or {}),
    }
    return JSONResponse(body)


async def streamed_events(
    sub: Submission,
    base: dict[str, Any],
    include_usage: bool,
    endpoint: str,
    render: Render,
    outputs: MergedOutputs | None = None,
    opening: Callable[[], bytes] | None = None,
    continuous: ChunkFrames | None = None,
) -> AsyncGenerator[bytes, None]:
    """The frame of a streamed response: `opening()` (frames sent before any output), then `render(index,
    out)` of each output (its frames joined, one write; b"" sends nothing), then the usage chunk when asked
    and `data: [DONE]`. `base`: every chunk's common fields (with `"usage": None` when usage is asked: every
    chunk carries the key, only the last fills it). `outputs`: `merged(sub)` (the default), or one already
    started (`first_read`). `continuous`: the frames `render` writes with, given the usage so far before
    each output (continuous usage stats). One generator between the engine's streams and the response: this
    runs per token."""
    completion_tokens = 0
    try:
        if opening is not None:
            if continuous is not None:
                continuous.set_usage(sub.usage(0))
            yield opening()
        async with contextlib.aclosing(merged(sub) if outputs is None else outputs) as merged_outputs:
            async for index, out in merged_outputs:
                completion_tokens += len(out.token_ids)
                if continuous is not None:
                    continuous.set_usage(sub.usage(completion_tokens))
                frames = render(index, out)
                if frames:
                    yield frames
    except AsyncLLMError as exc:  # headers are sent: the error travels as an event, as OpenAI does
        yield sse(engine_error(exc).body())  # the engine died (503), failed this request (500), or refused it (400)
        return
    except Exception:
        logger.exception("asyncllm server: %s stream failed", endpoint)
        yield sse(OpenAIError("internal server error", status=500, type="server_error").body())
        return
    if include_usage:
        yield sse({**base, "choices": [], "usage": sub.usage(completion_tokens)})
    yield DONE
