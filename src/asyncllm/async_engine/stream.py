"""One request's stream: the async iterator over the output slot the step thread merges into.

The iterator is a class, not an async generator, so every way of leaving it aborts the request
synchronously: task cancellation (asyncio's CancelledError, trio's Cancelled), `aclose()`, and garbage
collection (`__del__`, which is also what a `break` out of `async for` leads to). The slot and its lock
belong to mailbox.py, the loop library behind the waiter to loops.py. Knows nothing of the engine core.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
from collections.abc import Callable

from asyncllm.async_engine.mailbox import OutputSlot
from asyncllm.errors import AsyncLLMError, StreamInUseError
from asyncllm.outputs import RequestOutput, StreamOutput, new_accumulator


class RequestStream:
    """`async for chunk in stream` yields `StreamOutput`s until one has a finish reason.

    Leaving early in any way (cancellation, `break`, `aclose()`, losing the last reference) aborts the
    request; the abort goes synchronously into the engine's inbox and is idempotent.

    A task cancelled while it runs the body of its `async for` (not awaiting the stream) keeps the stream
    alive through the CancelledError's traceback for as long as the task object lives, so on asyncio the
    task that last read a stream is watched too: if it ends cancelled with the stream unfinished, the stream
    aborts. trio has no such hook: a scope cancelled there aborts when the stream is dropped.

    One task reads a stream at a time: a second reader raises `StreamInUseError`. A request that failed
    alone (its prompt turned out too long once tokenized, say) raises `InvalidRequestError` after the
    chunks it produced, and `RequestFailedError` when the engine failed it (not the caller's fault).

    With `SamplingParams.n` > 1 the chunks of the n samples interleave, each labelled with its sample's
    `index` and ending that sample with its `finish_reason`; the stream ends once every sample has ended.
    """

    def __init__(self, slot: OutputSlot, abort: Callable[[OutputSlot], None]) -> None:
        self._slot = slot
        self._abort = abort
        self._done = False  # the final chunk was returned, an error raised, or the stream closed
        self._reader: asyncio.Task[object] | None = None  # the task that last read, watched while unfinished
        self._on_reader_done = _ReaderWatch(weakref.ref(self))  # weak: never delays garbage collection

    @property
    def request_id(self) -> str:
        return self._slot.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...] | None:
        """The prompt's token ids (a copy: the core's own list never leaves it). A text prompt's are known
        once it is tokenized, off the loop: None before that, always set by the time a chunk arrives."""
        return self._slot.prompt_token_ids

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def num_samples(self) -> int:
        """`SamplingParams.n`: the samples whose chunks this stream carries."""
        return self._slot.num_samples

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        slot = self._slot
        loop = slot.mailbox.loop
        if not self._done:
            if not loop.is_current():
                raise RuntimeError(
                    f"stream {slot.request_id!r} belongs to another event loop: iterate it in the loop "
                    "that called add_request"
                )
            if slot.waiter is not None:
                raise StreamInUseError(
                    f"stream {slot.request_id!r} is already being read by another task: read a stream from "
                    "one task at a time"
                )
            if loop.is_asyncio:
                task = asyncio.current_task()
                if task is not self._reader:
                    self._watch(task)
        while True:
            if self._done:
                raise StopAsyncIteration
            try:
                out = slot.take_or_wait()
            except AsyncLLMError:  # the engine died, or this request failed alone: it has ended
                self._end()
                raise
            if isinstance(out, StreamOutput):
                if out.finish_reason is not None and slot.is_last(out):
                    self._end()
                return out
            try:
                handed = await loop.wait(out)
            except BaseException:  # cancelled (asyncio's CancelledError, trio's Cancelled), or interrupted
                self.close()
                raise
            finally:
                slot.waiter = None
            if isinstance(handed, StreamOutput):  # the wake-up brought the chunk: no take of our own
                if handed.finish_reason is not None and slot.is_last(handed):
                    self._end()
                return handed

    def close(self) -> None:
        """Stop reading; abort the request unless it already ended. Safe from any thread, idempotent."""
        if self._done:
            return
        self._done = True
        if not self._slot.finished:
            self._abort(self._slot)
        self._unwatch_from_any_thread()

    def _watch(self, task: asyncio.Task[object] | None) -> None:
        """On the stream's loop: watch `task` (None: nobody) instead of the previous reader."""
        if self._reader is not None:
            self._reader.remove_done_callback(self._on_reader_done)
        self._reader = task
        if task is not None:
            task.add_done_callback(self._on_reader_done)

    def _unwatch_from_any_thread(self) -> None:
        # A long-lived task reading many streams must not collect their callbacks; but `close` may run
        # in any thread (garbage collection), and a task's callbacks belong to its loop's thread.
        reader = self._reader
        if reader is None:
            return
        loop = self._slot.mailbox.loop
        if loop.is_current():
            self._watch(None)
            return
        self._reader = None
        with contextlib.suppress(RuntimeError):  # a closed loop: its tasks and callbacks are gone with it
            loop.call_soon_threadsafe(functools.partial(reader.remove_done_callback, self._on_reader_done))

    def _end(self) -> None:
        """The last chunk or the error was handed out: nothing to abort, stop watching the reader."""
        self._done = True
        if self._reader is not None:
            self._watch(None)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # A `break` out of `async for`, or a consumer that simply drops the stream, ends up here.
        if getattr(self, "_done", True) is False:
            self.close()


class _ReaderWatch:
    """Done-callback of a stream's reading task: a cancelled reader aborts the stream it left unfinished.

    (Only cancellation: a reader that returns may have handed the stream on, and asking a failed task for
    its exception would hide "Task exception was never retrieved".)"""

    __slots__ = ("_stream",)

    def __init__(self, stream: weakref.ref[RequestStream]) -> None:
        self._stream = stream

    def __call__(self, task: asyncio.Task[object]) -> None:
        stream = self._stream()
        if stream is not None and stream._reader is task:
            stream._reader = None
            if task.cancelled():
                stream.close()


async def collect(stream: RequestStream) -> RequestOutput:
    """The whole result of a stream, read to its end. Leaving early (cancellation, an error) aborts it."""
    output = new_accumulator(stream.num_samples)
    try:
        async for chunk in stream:
            output.add_chunk(chunk)
    finally:
        stream.close()  # a no-op once finished; otherwise (an error) the request must not run on
    assert output.finished, "a stream ends with a final chunk"
    # prompt_token_ids is None only if the request was aborted before it was tokenized.
    return output.result(stream.request_id, list(stream.prompt_token_ids or ()))
