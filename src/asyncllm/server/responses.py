"""What the chat and completion endpoints share around their own choice shapes: the whole (non-streamed)
response object, and the frame of a streamed one (each endpoint's events, then the usage chunk when asked
and `data: [DONE]`; a failure after the headers went out travels as an error event, as OpenAI sends it)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.responses import JSONResponse

from asyncllm.errors import AsyncLLMError
from asyncllm.outputs import OutputAccumulator, StreamOutput
from asyncllm.server.errors import OpenAIError, engine_error
from asyncllm.server.generation import MergedOutputs, Submission, merged, usage
from asyncllm.server.streaming import DONE, sse

logger = logging.getLogger("asyncllm.server")

Outputs = AsyncIterator[tuple[int, StreamOutput]]  # (choice index, its next output), as they come


def whole_response(
    head: dict[str, Any],
    object_name: str,
    choices: list[dict[str, Any]],
    sub: Submission,
    results: list[OutputAccumulator],
) -> JSONResponse:
    completion_tokens = sum(len(r.token_ids) for r in results)
    body = {
        **head,
        "object": object_name,
        "choices": choices,
        "usage": usage(sub.num_prompt_tokens, completion_tokens),
        "system_fingerprint": None,
    }
    return JSONResponse(body)


async def streamed_events(
    sub: Submission,
    base: dict[str, Any],
    include_usage: bool,
    endpoint: str,
    render: Callable[[Outputs], AsyncGenerator[str, None]],
    outputs: MergedOutputs | None = None,
) -> AsyncGenerator[str, None]:
    """`render(outputs)` yields the endpoint's own events; this adds the frame. `base`: every chunk's common
    fields (with `"usage": None` when usage is asked: every chunk carries the key, only the last fills it).
    `outputs`: `merged(sub)` (the default), or one already started (`first_read`)."""
    completion_tokens = 0

    async def counted(outputs: Outputs) -> Outputs:
        nonlocal completion_tokens
        async for index, out in outputs:
            completion_tokens += len(out.token_ids)
            yield index, out

    try:
        async with (
            contextlib.aclosing(merged(sub) if outputs is None else outputs) as merged_outputs,
            contextlib.aclosing(render(counted(merged_outputs))) as events,
        ):
            async for event in events:
                yield event
    except AsyncLLMError as exc:  # headers are sent: the error travels as an event, as OpenAI does
        yield sse(engine_error(exc).body())  # the engine died (503), failed this request (500), or refused it (400)
        return
    except Exception:
        logger.exception("asyncllm server: %s stream failed", endpoint)
        yield sse(OpenAIError("internal server error", status=500, type="server_error").body())
        return
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(sub.num_prompt_tokens, completion_tokens)})
    yield DONE
