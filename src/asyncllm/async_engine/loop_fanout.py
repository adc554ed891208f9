"""Handing a step's outputs to the event loops that asked for them: at most one wake-up per loop per step.

Each loop has a `LoopMailbox` (mailbox.py); the fanout keeps one per loop with live requests, groups a
step's deltas by loop and posts each group under one lock acquisition, so a loop that lags never
accumulates callbacks, only merged unread output. Knows nothing of the engine core; never blocks on a
consumer.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING

from asyncllm.async_engine.loops import make_loop
from asyncllm.async_engine.mailbox import LoopMailbox, OutputSlot

if TYPE_CHECKING:
    from asyncllm.core.output_processor import RequestDelta


class LoopFanout:
    """The mailboxes of every loop with live requests (a loop's mailbox goes with its last request)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mailboxes: dict[Hashable, LoopMailbox] = {}  # by loop key (asyncio loop, trio token)

    def attach(self, library: str, key: Hashable) -> LoopMailbox:
        """A caller's thread, for one new request on the loop `loops.current_loop_key()` named; pair with
        one `detach`."""
        with self._lock:
            mailbox = self._mailboxes.get(key)
            if mailbox is None:
                mailbox = self._mailboxes[key] = LoopMailbox(make_loop(library, key))
            mailbox.num_slots += 1
            return mailbox

    def detach(self, mailbox: LoopMailbox) -> None:
        with self._lock:
            mailbox.num_slots -= 1
            key = mailbox.loop.key
            if mailbox.num_slots == 0 and self._mailboxes.get(key) is mailbox:
                del self._mailboxes[key]

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
