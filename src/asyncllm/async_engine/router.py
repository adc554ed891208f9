"""Routing a core's outputs to the streams waiting for them, and ending every stream when the core dies.

The registry of live requests (`ids.LiveRequests`) says which slot an output feeds and when a request
leaves; the fanout (`loop_fanout.LoopFanout`) hands each event loop its share of a step at once. `route`
runs on the thread that drives a core (the step thread; for a core elsewhere, the thread that receives its
outputs); `close` from any thread. `StepRouter` is what a core's driver needs of it (`InProcClient` behind
a Ray actor routes through another one: `asyncllm.ray.outbox`). Knows nothing of the core nor of the loop
libraries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from asyncllm.errors import EngineDeadError

if TYPE_CHECKING:
    from asyncllm.async_engine.ids import LiveRequests
    from asyncllm.async_engine.loop_fanout import LoopFanout
    from asyncllm.async_engine.mailbox import OutputSlot
    from asyncllm.core.output_processor import RequestDelta


class Addressed(Protocol):
    """What a driver knows of the place a request's outputs go: only its request id."""

    @property
    def request_id(self) -> str: ...


S = TypeVar("S", bound=Addressed)


class StepRouter(Protocol[S]):
    """Where a core's driver sends what it learns, with `S` the handle of one request's output."""

    def is_live(self, slot: S) -> bool:
        """`slot` is still its id's live request (messages about any other incarnation are dropped)."""
        ...

    def started(self, request_ids: Sequence[str]) -> None:
        """These requests' first step was planned (reported before the same steps' outputs)."""
        ...

    def route(self, deltas: list[RequestDelta]) -> Sequence[S]:
        """One step's outputs; returns the slots nobody will read, whose requests should be aborted."""
        ...

    def close(self, message: str, cause: BaseException | None) -> None:
        """The core is gone (failed, or shut down): every live request ends with `EngineDeadError`."""
        ...


class OutputRouter:
    def __init__(self, live: LiveRequests[OutputSlot], fanout: LoopFanout) -> None:
        self._live = live
        self._fanout = fanout

    def is_live(self, slot: OutputSlot) -> bool:
        """`slot` is still its id's live request: not finished, not ended by a failure or shutdown."""
        return self._live.get(slot.request_id) is slot

    def started(self, request_ids: Sequence[str]) -> None:
        """These requests' first step was planned: they stop counting against `max_waiting_requests`. A
        client reports them before routing the outputs of the same steps (a request may start and end in one)."""
        if request_ids:
            self._live.started(request_ids)

    def route(self, deltas: list[RequestDelta]) -> list[OutputSlot]:
        """One step's outputs to their streams (those of requests no longer live are dropped); a request
        whose output is final leaves the registry. Returns the slots still owed output whose event loop is
        closed: nobody will read them, so their requests should be aborted rather than computed on."""
        if not deltas:
            return []
        # `ends_request`, inlined: this runs for every sequence of every step.
        finished = [(d.finish_reason is not None and not d.open_samples) or d.error is not None for d in deltas]
        slots = self._live.resolve([d.request_id for d in deltas], finished)
        items = [(slot, delta) for slot, delta in zip(slots, deltas) if slot is not None]
        orphans = self._fanout.deliver(items)
        for slot, done in zip(slots, finished):
            if slot is not None and done:
                self._fanout.detach(slot.mailbox)
        return [slot for slot in orphans if not slot.finished]

    def close(self, message: str, cause: BaseException | None) -> None:
        """The core is gone: every live stream ends with `EngineDeadError(message)` (cause chained) once it
        has read what it was sent, and every later request is refused with it. Idempotent."""

        def make_error() -> EngineDeadError:
            error = EngineDeadError(message)
            error.__cause__ = cause
            return error

        slots = self._live.close(make_error)
        self._fanout.fail(slots, message, cause)
        for slot in slots:
            self._fanout.detach(slot.mailbox)


def ends_request(delta: RequestDelta) -> bool:
    """`delta` is its request's last: a sample's end is the request's once no sample of it is open
    (`open_samples`, 0 for n = 1); an error ends every sample."""
    return (delta.finish_reason is not None and not delta.open_samples) or delta.error is not None
