"""Inside a replica: the `StepRouter` its step thread routes through, gathering outputs into `Batch`es.

The replica runs the same `InProcClient` as a single engine; where the front's router hands each step to
event loops, this one appends it to the batch the actor's output stream sends next, and wakes that stream
(once until it takes the batch). A request is known here by a `Ticket`, live from its add until its final
output, so stale aborts are dropped exactly as in the front. Knows nothing of Ray or of the front.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from asyncllm.async_engine.router import ends_request
from asyncllm.ray.wire import Batch, portable

if TYPE_CHECKING:
    from asyncllm.core.output_processor import RequestDelta


class Ticket:
    """One incarnation of a request id inside the replica."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class ReplicaOutbox:
    """`admit`, `ticket`, `take` from the actor's loop; `started`, `route`, `close` from the step thread.
    `wake` is called (from the step thread) when a batch is due and nobody was woken for it yet."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._live: dict[str, Ticket] = {}
        self._batch = Batch()
        self._due = False  # something the stream has not taken yet
        self._woken = False  # `wake` was called since the last `take`
        self._published: dict[str, float | int] = {}
        self.stats: Callable[[], dict[str, float | int]] = dict  # the client's snapshot, once it is built

    def admit(self, request_id: str) -> Ticket:
        ticket = self._live[request_id] = Ticket(request_id)
        return ticket

    def ticket(self, request_id: str) -> Ticket | None:
        return self._live.get(request_id)

    # ------------------------------------------------------------------ StepRouter (the step thread)
    def is_live(self, slot: Ticket) -> bool:
        return self._live.get(slot.request_id) is slot

    def started(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            with self._lock:
                self._batch.started.extend(request_ids)

    def route(self, deltas: list[RequestDelta]) -> Sequence[Ticket]:
        """Called after every turn of the step loop, with the stats already taken: publishes when anything
        changed (every step does: its count of steps). Nothing is orphaned here: the front decides that."""
        stats = self.stats()
        if not deltas and stats == self._published:
            return ()
        self._published = stats
        live = self._live
        for d in deltas:
            if ends_request(d):
                live.pop(d.request_id, None)
        busy = bool(stats.get("num_running") or stats.get("num_waiting"))
        with self._lock:
            batch = self._batch
            batch.deltas.extend(deltas)
            batch.stats, batch.busy = stats, busy
            self._due = True
            wake, self._woken = not self._woken, True
        if wake:
            self._wake()
        return ()

    def close(self, message: str, cause: BaseException | None) -> None:
        with self._lock:
            if self._batch.dead is None:
                self._batch.dead = (message, portable(cause))
            self._live.clear()
            self._due = True
            wake, self._woken = not self._woken, True
        if wake:
            self._wake()

    # ------------------------------------------------------------------ the actor's loop
    def take(self) -> Batch | None:
        """What is due since the last call (None: nothing), and re-arm the wake-up."""
        with self._lock:
            self._woken = False
            if not self._due:
                return None
            batch, self._due = self._batch, False
            self._batch = Batch(stats=batch.stats, busy=batch.busy, dead=batch.dead)
            return batch
