"""One HTTP request's engine requests: submitted together (prompts x params), read merged, closed together;
an engine request of `n` samples is n choices.

Owns the invariant the field keeps breaking: however the reader leaves (client disconnect -> task
cancelled, generator closed, engine failure), every engine stream of the request is closed, which aborts
what is still running and frees its blocks. Knows nothing of OpenAI response shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncllm import AsyncLLMEngine, SamplingParams, StreamOutput
from asyncllm.errors import AsyncLLMError, InvalidRequestError, RequestTimeoutError
from asyncllm.outputs import OutputAccumulator
from asyncllm.server.errors import invalid_request
from asyncllm.server.metrics import RequestTracker, ServerMetrics

Prompt = str | list[int]
MergedOutputs = AsyncGenerator[tuple[int, StreamOutput], None]  # (choice index, its next output)


class RequestStream(Protocol):
    """What `engine.add_request` returns, as far as the server relies on it."""

    @property
    def prompt_token_ids(self) -> tuple[int, ...] | None: ...  # None until a text prompt is tokenized

    def close(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[StreamOutput]: ...


@dataclass
class Submission:
    """Engine requests in choice order: prompt by prompt, and each prompt's in the order of its params.
    Sample j of `streams[k]` is OpenAI's choice `first_choice[k] + j`; `trackers` go by choice."""

    streams: list[RequestStream]
    trackers: list[RequestTracker]
    num_prompts: int
    first_choice: list[int]
    # Prompt tokens the prefix cache served, per stream, as its samples' final chunks report them.
    cached: dict[int, int] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return len(self.trackers)

    @property
    def num_prompt_tokens(self) -> int:
        """Each prompt counted once, whatever n is (as OpenAI's usage does); read once the streams ended (a
        text prompt is tokenized off the event loop, after `add_request` returned)."""
        n = len(self.streams) // self.num_prompts
        return sum(len(self.streams[i * n].prompt_token_ids or ()) for i in range(self.num_prompts))

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served by the prefix cache, each prompt counted once (as `num_prompt_tokens`)."""
        n = len(self.streams) // self.num_prompts
        return sum(self.cached.get(i * n, 0) for i in range(self.num_prompts))

    def note_end(self, stream: int, out: StreamOutput) -> None:
        """A sample's final chunk: keep its stream's prefix-cache hits (the samples share one prompt)."""
        if out.metrics is not None:
            self.cached[stream] = max(self.cached.get(stream, 0), out.metrics.num_cached_tokens)

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return usage(self.num_prompt_tokens, completion_tokens, self.num_cached_tokens)

    def close(self) -> None:
        """Abort every stream still running (the client left). Synchronous and idempotent."""
        for stream in self.streams:
            stream.close()  # a no-op for a stream that ended; else the abort is in the engine's inbox on return
        for tracker in self.trackers:
            tracker.end("abort")  # a no-op for a choice whose end was recorded


def submit(
    engine: AsyncLLMEngine,
    prompts: Sequence[Prompt],
    params: Sequence[SamplingParams],
    request_id: str,
    metrics: ServerMetrics,
    prompt_param: str,
    priority: int = 0,
    lora: str | None = None,
    timeout: float | None = None,
) -> Submission:
    """Add every engine request, or none: a refused one (400 naming `prompt_param`) closes those added.
    `lora`: the LoRA adapter every request runs through (None: the base model); `timeout`: seconds each
    has (checked: `ServerState.timeout_for`)."""
    streams: list[RequestStream] = []
    first_choice: list[int] = []
    num_choices = 0
    try:
        for prompt in prompts:
            for sp in params:
                streams.append(
                    engine.add_request(
                        prompt, sp, f"{request_id}-{num_choices}", priority=priority, lora=lora, timeout=timeout
                    )
                )
                first_choice.append(num_choices)
                num_choices += sp.n
    except InvalidRequestError as exc:
        _close_all(streams)
        raise invalid_request(exc, param=prompt_param) from None
    except BaseException:
        _close_all(streams)
        raise
    trackers = [metrics.track(f"{request_id}-{choice}") for choice in range(num_choices)]
    return Submission(streams, trackers, len(prompts), first_choice)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's `usage` object; `prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache served."""
    total = prompt_tokens + completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _close_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.close()  # synchronous and idempotent: the abort is in the engine's inbox on return


async def merged(sub: Submission) -> MergedOutputs:
    """(choice index, chunk) from every stream as chunks arrive, until each has ended.

    Leaving early in any way closes every unfinished stream; an engine failure raises `EngineDeadError`, a
    request that failed alone its own error (`InvalidRequestError`, `RequestFailedError`).
    """
    streams, trackers, first = sub.streams, sub.trackers, sub.first_choice
    tasks: list[asyncio.Task[None]] = []
    try:
        if len(streams) == 1:  # the common case: no helper task, no queue
            async for chunk in streams[0]:
                trackers[chunk.index].observe(chunk)
                if chunk.finish_reason is not None:
                    sub.note_end(0, chunk)
                yield chunk.index, chunk
            return
        queue: asyncio.Queue[tuple[int, StreamOutput | None, Exception | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait((index, chunk, None))
            except Exception as exc:  # an AsyncLLMError; cancellation propagates (the stream aborts itself)
                queue.put_nowait((index, None, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = sub.num_choices
        while remaining:
            k, out, error = await queue.get()
            if error is not None:
                raise error
            assert out is not None
            choice = first[k] + out.index
            trackers[choice].observe(out)
            if out.finish_reason is not None:
                sub.note_end(k, out)
                remaining -= 1
            yield choice, out
    except AsyncLLMError as exc:  # counted as "error" (or "timeout"), not as a client that left
        for tracker in trackers:
            tracker.end("timeout" if isinstance(exc, RequestTimeoutError) else "error")
        raise
    finally:
        for task in tasks:
            task.cancel()
        sub.close()


async def first_read(sub: Submission) -> MergedOutputs:
    """`merged(sub)` with its first output already read, so that what the engine checks off the loop (a
    text prompt's length once tokenized, an output constraint's compile) raises here, before a streamed
    response commits to a status. Closing what it returns closes `merged(sub)`."""
    outputs = merged(sub)
    try:
        first = await outputs.__anext__()
    except BaseException:
        await outputs.aclose()
        raise
    return _after(first, outputs)


async def _after(first: tuple[int, StreamOutput], rest: MergedOutputs) -> MergedOutputs:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def collect(sub: Submission) -> list[OutputAccumulator]:
    """Each choice's whole output (`text`, `token_ids`, `logprobs`, `finish_reason`), for non-streamed responses."""
    results = [OutputAccumulator() for _ in range(sub.num_choices)]
    async with contextlib.aclosing(merged(sub)) as outputs:
        async for index, chunk in outputs:
            results[index].add_chunk(chunk)
    return results
