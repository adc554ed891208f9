"""One request's stream: the output slot the step thread merges into, and the async iterator over it.

The slot is shared state guarded by its event loop's mailbox lock: the step thread merges deltas into it
(merge-on-put, so a lagging consumer costs memory only for unread tokens and the engine never waits), the
consumer takes the merged chunk. The iterator is a class, not an async generator, so every way of leaving
it aborts the request synchronously: task cancellation, `aclose()`, and garbage collection (`__del__`,
which is also what a `break` out of `async for` leads to). Knows nothing of the engine core.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncllm.errors import EngineDeadError
from asyncllm.outputs import FinishReason, RequestMetrics, StreamOutput

if TYPE_CHECKING:
    from asyncllm.async_engine.loop_fanout import LoopMailbox
    from asyncllm.core.output_processor import RequestDelta


class OutputSlot:
    """Output owed to one consumer and not yet read. Every method but `wake` runs under `mailbox.lock`."""

    __slots__ = (
        "_logprobs",
        "_texts",
        "_token_ids",
        "error",
        "final_put",
        "finish_reason",
        "mailbox",
        "metrics",
        "request_id",
        "waiter",
    )

    def __init__(self, request_id: str, mailbox: LoopMailbox) -> None:
        self.request_id = request_id
        self.mailbox = mailbox
        self._token_ids: list[int] = []
        self._texts: list[str] = []
        self._logprobs: list[dict[int, float]] | None = None  # only for requests that asked for them
        self.finish_reason: FinishReason | None = None
        self.metrics: RequestMetrics | None = None
        self.final_put = False  # the final delta (or an error) has been put: nothing more will come
        self.error: tuple[str, BaseException | None] | None = None  # (message, cause) of EngineDeadError
        self.waiter: asyncio.Future[None] | None = None  # touched only on the mailbox's loop

    def merge(self, delta: RequestDelta) -> None:
        """Step thread: join one step's delta onto whatever the consumer has not read yet."""
        if self.final_put:
            return  # e.g. an abort raced a finish: the first final output wins
        self._token_ids.extend(delta.new_token_ids)
        if delta.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(delta.logprobs)
        if delta.new_text:
            self._texts.append(delta.new_text)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.metrics = delta.metrics
            self.final_put = True

    def fail(self, message: str, cause: BaseException | None) -> None:
        if self.final_put:
            return
        self.error = (message, cause)
        self.final_put = True

    def take(self) -> StreamOutput | None:
        """Consumer: the merged unread chunk, None if there is nothing yet; raises once only an error is left."""
        if self._token_ids or self._texts or self.finish_reason is not None:
            out = StreamOutput(
                request_id=self.request_id,
                text="".join(self._texts),
                token_ids=tuple(self._token_ids),
                finish_reason=self.finish_reason,
                metrics=self.metrics,
                logprobs=tuple(self._logprobs) if self._logprobs is not None else None,
            )
            self._token_ids = []
            self._texts = []
            self._logprobs = None
            return out
        if self.error is not None:
            message, cause = self.error
            raise EngineDeadError(message) from cause  # a fresh instance per stream: tracebacks stay apart
        return None

    def wake(self) -> None:
        """Consumer's loop: resume the coroutine waiting on this slot, if any."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class RequestStream:
    """`async for chunk in stream` yields `StreamOutput`s until one has a finish reason.

    Leaving early in any way (cancellation, `break`, `aclose()`, losing the last reference) aborts the
    request; the abort goes synchronously into the engine's inbox and is idempotent.

    A task cancelled while it runs the body of its `async for` (not awaiting the stream) keeps the stream
    alive through the CancelledError's traceback for as long as the task object lives, so the task that
    last read a stream is watched too: if it ends cancelled with the stream unfinished, the stream aborts.
    """

    def __init__(self, slot: OutputSlot, prompt_token_ids: list[int], abort: Callable[[OutputSlot], None]) -> None:
        self._slot = slot
        self._abort = abort
        self._done = False  # the final chunk was returned, an error raised, or the stream closed
        self._reader: asyncio.Task[object] | None = None  # the task that last read, watched while unfinished
        self._on_reader_done = _ReaderWatch(weakref.ref(self))  # weak: never delays garbage collection
        self.prompt_token_ids = prompt_token_ids

    @property
    def request_id(self) -> str:
        return self._slot.request_id

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        slot = self._slot
        mailbox = slot.mailbox
        if not self._done and asyncio.get_running_loop() is not mailbox.loop:
            raise RuntimeError(
                f"stream {slot.request_id!r} belongs to another event loop: iterate it in the loop "
                "that called add_request"
            )
        task = asyncio.current_task()
        if task is not self._reader and not self._done:
            self._watch(task)
        while True:
            if self._done:
                raise StopAsyncIteration
            with mailbox.lock:
                try:
                    out = slot.take()
                except EngineDeadError:
                    self._end()
                    raise
                if out is None:
                    waiter = slot.waiter = mailbox.loop.create_future()
            if out is not None:
                if out.finish_reason is not None:
                    self._end()
                return out
            try:
                await waiter
            except asyncio.CancelledError:
                self.close()
                raise
            finally:
                slot.waiter = None

    def close(self) -> None:
        """Stop reading; abort the request unless it already ended. Safe from any thread, idempotent."""
        if self._done:
            return
        self._done = True
        if not self._slot.final_put:
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
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._watch(None)
            return
        self._reader = None
        with contextlib.suppress(RuntimeError):  # a closed loop: its tasks and callbacks are gone with it
            loop.call_soon_threadsafe(reader.remove_done_callback, self._on_reader_done)

    def _end(self) -> None:
        """The last chunk or the error was handed out: nothing to abort, stop watching the reader."""
        self._done = True
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
