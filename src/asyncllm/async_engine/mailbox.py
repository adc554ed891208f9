"""One event loop's mailbox: the lock over its requests' output slots, and the slots themselves.

The step thread merges each step's deltas into slots (each an `OutputAccumulator`) under the mailbox lock
(merge-on-put, so a lagging consumer costs memory only for unread tokens and the engine never waits) and
queues at most one wake-up callback on the loop; that wake-up hands each waiting consumer its merged chunk
(asyncio), or the consumer takes it under the same lock (a reader that was busy, or trio). The lock and
every piece of state it guards live here, and nowhere else takes it. A request of n > 1 samples has a
`SamplesSlot`, which keeps each sample's output apart. Knows nothing of the engine core, nor which event
loop library it serves (`loops.EventLoop` hides that).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from asyncllm.async_engine.loops import EventLoop
from asyncllm.errors import AsyncLLMError, EngineDeadError
from asyncllm.outputs import (
    FinishReason,
    OutputAccumulator,
    RequestMetrics,
    SamplesAccumulator,
    StreamOutput,
    TokenLogprobs,
    request_error,
)

if TYPE_CHECKING:
    from asyncllm.core.output_processor import RequestDelta


class OutputSlot(OutputAccumulator):
    """Output owed to one consumer and not yet read: an accumulator the step thread adds each step's delta
    to and the consumer takes merged chunks from. Its state is guarded by `mailbox.lock`."""

    __slots__ = ("dead", "mailbox", "pooled", "prompt_token_ids", "request_id", "waiter")

    def __init__(self, request_id: str, mailbox: LoopMailbox) -> None:
        super().__init__()
        self.request_id = request_id
        self.mailbox = mailbox
        self.dead: tuple[str, BaseException | None] | None = None  # (message, cause) of EngineDeadError
        self.waiter: Any = None  # the consumer's waiter (loops.EventLoop), touched only on the mailbox's loop
        # Set once, before the request reaches the core (a text prompt: once tokenized). A tuple: the core's
        # own list never leaves it, so no caller can change what the scheduler counts.
        self.prompt_token_ids: tuple[int, ...] | None = None
        self.pooled: list[float] | None = None  # a pooling request's vector, from its final delta

    @property
    def num_samples(self) -> int:
        return 1

    def take_or_wait(self) -> StreamOutput | Any:
        """Consumer, on the slot's loop: the merged unread chunk, or a waiter the next wake-up resolves.

        Raises EngineDeadError, or the request's own error (`request_error`), once only that error is left.
        """
        with self.mailbox.lock:
            out = self._take_locked()
            if out is not None:
                return out
            waiter = self.waiter = self.mailbox.loop.new_waiter()
            return waiter

    def _fail_locked(self, message: str, cause: BaseException | None) -> None:
        if self.finished:
            return
        self.dead = (message, cause)
        self.finished = True

    def _take_locked(self) -> StreamOutput | None:
        out = self.take_chunk(self.request_id)
        if out is not None:
            return out
        if self.error is not None:  # this request failed alone: what it had was read first, now the error
            raise request_error(self.error)
        if self.dead is not None:
            message, cause = self.dead
            raise EngineDeadError(message) from cause  # a fresh instance per stream: tracebacks stay apart
        return None


class SamplesSlot(OutputSlot):
    """The slot of a request with n > 1 samples: the same calls, each delta joined to its own sample's
    output (`SamplesAccumulator`), so a lagging consumer gets merged chunks per sample, one at a time; it is
    finished once every sample is (or the request failed, or the engine died)."""

    __slots__ = ("samples",)

    def __init__(self, request_id: str, mailbox: LoopMailbox, n: int) -> None:
        super().__init__(request_id, mailbox)
        self.samples = SamplesAccumulator(n)

    @property
    def num_samples(self) -> int:
        return len(self.samples.samples)

    def add(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: FinishReason | None = None,
        metrics: RequestMetrics | None = None,
        error: str | AsyncLLMError | None = None,
        index: int = 0,
        prompt_logprobs: Sequence[TokenLogprobs | None] | None = None,
    ) -> None:
        if self.finished:  # every sample ended, or the engine died
            return
        samples = self.samples
        samples.add(text, token_ids, logprobs, finish_reason, metrics, error, index, prompt_logprobs)
        self.error = samples.error
        self.finished = samples.finished

    def take_chunk(self, request_id: str, index: int = 0) -> StreamOutput | None:
        return self.samples.take_chunk(request_id)

    def is_last(self, chunk: StreamOutput) -> bool:
        return self.samples.complete


def new_slot(request_id: str, mailbox: LoopMailbox, n: int) -> OutputSlot:
    """The slot for a request of `n` samples."""
    return OutputSlot(request_id, mailbox) if n == 1 else SamplesSlot(request_id, mailbox, n)


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
            for slot, d in items:  # join each delta onto what the consumer has not read yet
                if d.pooled is not None and not slot.finished:
                    slot.pooled = d.pooled
                slot.add(
                    d.new_text,
                    d.new_token_ids,
                    d.logprobs,
                    d.finish_reason,
                    d.metrics,
                    d.error,
                    d.index,
                    d.prompt_logprobs,
                )
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
                    wakes.append((waiter, slot.take_chunk(slot.request_id) if loop.can_hand_over(waiter) else None))
        for waiter, chunk in wakes:
            loop.wake(waiter, chunk)
