"""Handing a step's outputs to the event loops that asked for them: at most one wake-up per loop per step.

Each loop has a mailbox: one lock over all its requests' output slots, the set of slots with unread
output, and a flag saying a wake-up callback is already queued on that loop. The step thread merges a
whole step's deltas under one lock acquisition per loop and calls `call_soon_threadsafe` only if no
wake-up is pending, so a loop that lags never accumulates callbacks, only merged unread output.
Knows nothing of the engine core; never blocks on a consumer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncllm.async_engine.stream import OutputSlot
    from asyncllm.core.output_processor import RequestDelta


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
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
                slot.merge(delta)
                self._ready[slot] = None
            return self._schedule_wake_locked()

    def fail(self, slots: Iterable[OutputSlot], message: str, cause: BaseException | None) -> None:
        with self.lock:
            for slot in slots:
                slot.fail(message, cause)
                self._ready[slot] = None
            self._schedule_wake_locked()

    def _schedule_wake_locked(self) -> bool:
        if self._wake_pending:
            return True
        try:
            # Called under the lock so a concurrent `_flush` cannot clear the flag between check and call;
            # call_soon_threadsafe only appends to the loop's queue and writes its self-pipe: it never waits.
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed
            return False
        self._wake_pending = True
        return True

    def _flush(self) -> None:
        """The loop's thread: wake every consumer with unread output."""
        with self.lock:
            ready = self._ready
            self._ready = {}
            self._wake_pending = False
        for slot in ready:
            slot.wake()


class LoopFanout:
    """The mailboxes of every loop with live requests (a loop's mailbox goes with its last request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mailboxes: dict[asyncio.AbstractEventLoop, LoopMailbox] = {}

    def attach(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        """A caller's thread, for one new request on `loop`; pair with one `detach`."""
        with self._lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = LoopMailbox(loop)
            mailbox.num_slots += 1
            return mailbox

    def detach(self, mailbox: LoopMailbox) -> None:
        with self._lock:
            mailbox.num_slots -= 1
            if mailbox.num_slots == 0 and self._mailboxes.get(mailbox.loop) is mailbox:
                del self._mailboxes[mailbox.loop]

    def deliver(self, items: list[tuple[OutputSlot, RequestDelta]]) -> list[OutputSlot]:
        """Step thread: one step's outputs to their loops. Returns the slots whose loop is closed."""
        by_mailbox: dict[LoopMailbox, list[tuple[OutputSlot, RequestDelta]]] = {}
        for item in items:
            by_mailbox.setdefault(item[0].mailbox, []).append(item)
        orphans: list[OutputSlot] = []
        for mailbox, batch in by_mailbox.items():
            if not mailbox.post(batch):
                orphans.extend(slot for slot, _ in batch)
        return orphans

    def fail(self, slots: list[OutputSlot], message: str, cause: BaseException | None) -> None:
        by_mailbox: dict[LoopMailbox, list[OutputSlot]] = {}
        for slot in slots:
            by_mailbox.setdefault(slot.mailbox, []).append(slot)
        for mailbox, batch in by_mailbox.items():
            mailbox.fail(batch, message, cause)

    @property
    def num_loops(self) -> int:
        return len(self._mailboxes)
