"""One event loop's mailbox: the lock over its requests' output slots, and the slots themselves.

The step thread merges each step's deltas into slots under the mailbox lock (merge-on-put, so a lagging
consumer costs memory only for unread tokens and the engine never waits) and queues at most one wake-up
callback on the loop; that wake-up hands each waiting consumer its merged chunk (asyncio), or the consumer
takes it under the same lock (a reader that was busy, or trio). The lock and every piece of state it guards
live here, and nowhere else takes it. Knows nothing of the engine core, nor which event loop library it
serves (`loops.EventLoop` hides that).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from asyncllm.async_engine.loops import EventLoop
from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.outputs import FinishReason, RequestMetrics, StreamOutput, TokenLogprobs

if TYPE_CHECKING:
    from asyncllm.core.output_processor import RequestDelta


class OutputSlot:
    """Output owed to one consumer and not yet read. Its state is guarded by `mailbox.lock`."""

    __slots__ = (
        "_logprobs",
        "_texts",
        "_token_ids",
        "error",
        "final_put",
        "finish_reason",
        "mailbox",
        "metrics",
        "prompt_token_ids",
        "request_error",
        "request_id",
        "waiter",
    )

    def __init__(self, request_id: str, mailbox: LoopMailbox) -> None:
        self.request_id = request_id
        self.mailbox = mailbox
        self._token_ids: list[int] = []
        self._texts: list[str] = []
        self._logprobs: list[TokenLogprobs] | None = None  # only for requests that asked for them
        self.finish_reason: FinishReason | None = None
        self.metrics: RequestMetrics | None = None
        self.final_put = False  # the final delta (or an error) has been put: nothing more will come
        self.error: tuple[str, BaseException | None] | None = None  # (message, cause) of EngineDeadError
        self.request_error: str | None = None  # why this request alone failed: raised as InvalidRequestError
        self.waiter: Any = None  # the consumer's waiter (loops.EventLoop), touched only on the mailbox's loop
        # Set once, before the request reaches the core (a text prompt: once tokenized). A tuple: the core's
        # own list never leaves it, so no caller can change what the scheduler counts.
        self.prompt_token_ids: tuple[int, ...] | None = None

    def take_or_wait(self) -> StreamOutput | Any:
        """Consumer, on the slot's loop: the merged unread chunk, or a waiter the next wake-up resolves.

        Raises EngineDeadError, or InvalidRequestError, once only that error is left.
        """
        with self.mailbox.lock:
            out = self._take_locked()
            if out is not None:
                return out
            waiter = self.waiter = self.mailbox.loop.new_waiter()
            return waiter

    def _merge_locked(self, delta: RequestDelta) -> None:
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
        if delta.error is not None:  # this request failed alone: what it had is read first, then the error
            self.request_error = delta.error
            self.final_put = True
        elif delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.metrics = delta.metrics
            self.final_put = True

    def _fail_locked(self, message: str, cause: BaseException | None) -> None:
        if self.final_put:
            return
        self.error = (message, cause)
        self.final_put = True

    def _take_output_locked(self) -> StreamOutput | None:
        """The merged unread chunk, if any (never an error)."""
        if not (self._token_ids or self._texts or self.finish_reason is not None):
            return None
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

    def _take_locked(self) -> StreamOutput | None:
        out = self._take_output_locked()
        if out is not None:
            return out
        if self.request_error is not None:
            raise InvalidRequestError(self.request_error)
        if self.error is not None:
            message, cause = self.error
            raise EngineDeadError(message) from cause  # a fresh instance per stream: tracebacks stay apart
        return None


class LoopMailbox:
    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()  # guards this mailbox and every slot bound to it
        self._ready: dict[OutputSlot, None] = {}  # slots with output since the last wake-up, in order
        self._wake_pending = False
        self.num_slots = 0  # live slots bound here; guarded by the fanout's lock

    def post(self, items: Iterable[tuple[OutputSlot, RequestDelta]]) -> bool:
        """Step thread: merge deltas into their slots and make sure the loop wakes once.

        Returns False when the loop is closed: nobody will ever read these slots.
        """
        with self.lock:
            for slot, delta in items:
                slot._merge_locked(delta)
                self._ready[slot] = None
            return self._schedule_wake_locked()

    def fail(self, slots: Iterable[OutputSlot], message: str, cause: BaseException | None) -> None:
        with self.lock:
            for slot in slots:
                slot._fail_locked(message, cause)
                self._ready[slot] = None
            self._schedule_wake_locked()

    def _schedule_wake_locked(self) -> bool:
        if self._wake_pending:
            return True
        try:
            # Called under the lock so a concurrent `_flush` cannot clear the flag between check and call;
            # call_soon_threadsafe only appends to the loop's queue and writes its self-pipe: it never waits.
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed (asyncio), or its run is over (trio.RunFinishedError)
            return False
        self._wake_pending = True
        return True

    def _flush(self) -> None:
        """The loop's thread: wake every consumer waiting on a slot with unread output. Where the loop can
        hand a value over, the waiting consumer gets its merged chunk with the wake-up, taken here under the
        one lock for all slots, so it need not take the lock again; an error is left for it to raise."""
        loop = self.loop
        wakes: list[tuple[Any, StreamOutput | None]] = []
        with self.lock:
            ready = self._ready
            self._ready = {}
            self._wake_pending = False
            for slot in ready:
                waiter = slot.waiter  # None: the consumer is busy; it takes the merged chunk when it asks
                if waiter is not None:
                    wakes.append((waiter, slot._take_output_locked() if loop.can_hand_over(waiter) else None))
        for waiter, chunk in wakes:
            loop.wake(waiter, chunk)
