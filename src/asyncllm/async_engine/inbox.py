"""The inbox: what the front sends a core (adds, aborts, ends, calls), from any thread, applied in arrival order.

Sending never waits on the core: an append to a deque (atomic) and a wake-up of the driver, which drains
the inbox at its own pace (the in-process step thread: at the start of every step and again right after the
forward pass). A message whose request is no longer live (finished, or the engine failed or shut down
meanwhile) is dropped, so aborts are idempotent and a stale one never hits a later request reusing its id.
A call (adding or removing a LoRA adapter) runs in the driver's thread between steps, its result or error set
on the caller's future; one the driver never runs (it stopped) fails with `EngineDeadError`. Knows nothing of
event loops, nor of the core beyond the calls its driver and callers hand it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple

from asyncllm.async_engine.router import S, StepRouter
from asyncllm.errors import EngineDeadError

if TYPE_CHECKING:
    from asyncllm.core.output_processor import RequestDelta
    from asyncllm.core.request import Request


@dataclass(slots=True)
class _Add(Generic[S]):
    request: Request
    slot: S


@dataclass(slots=True)
class _Abort(Generic[S]):
    slot: S  # which incarnation of the id: a stale abort never hits a later request reusing it


@dataclass(slots=True)
class _End(Generic[S]):
    slot: S  # a request that never reached the core (aborted or refused before): its last output
    delta: RequestDelta


class _Call(NamedTuple):
    fn: Callable[[], Any]  # runs in the driver's thread, between steps
    future: Future[Any]

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn()
        except Exception as exc:  # the call's own failure: its caller's, the engine carries on
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class Inbox(Generic[S]):
    """`add`, `abort`, `end`, `call`, `stop` and `notify` from any thread; `wait`, `pause`, `drain` and
    `fail_calls` from the driver's thread only. `S`: the router's handle on a request's output (`OutputSlot`
    in the front)."""

    def __init__(self, router: StepRouter[S]) -> None:
        self._router = router
        self._queue: deque[_Add[S] | _Abort[S] | _End[S] | _Call] = deque()  # append/popleft: atomic, no lock
        # Reentrant: a stream garbage-collected inside the driver's own locked region may enqueue an abort.
        # Admission shares it, for the same reason (see admission.py).
        self.lock = threading.RLock()
        self._cond = threading.Condition(self.lock)
        self.stopping = False  # set once: the driver exits, and aborts and ends are no-ops

    def add(self, request: Request, slot: S) -> None:
        self._queue.append(_Add(request, slot))
        self.notify()

    def abort(self, slot: S) -> None:
        """Synchronous and idempotent: an unknown, finished or already aborted request is a no-op."""
        if self.stopping:
            return
        self._queue.append(_Abort(slot))
        self.notify()

    def end(self, slot: S, delta: RequestDelta) -> None:
        """The last output of a request that never reached the core, routed in inbox order."""
        if self.stopping:
            return
        self._queue.append(_End(slot, delta))
        self.notify()

    def call(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        """Run `fn()` in the driver's thread, in order with the other messages; its result or exception goes
        to `future` (`EngineDeadError` once the driver stopped)."""
        with self.lock:  # against `fail_calls`: a call is either run, failed there, or refused here
            if self.stopping:
                future.set_exception(EngineDeadError("the engine is not running"))
                return
            self._queue.append(_Call(fn, future))
        self.notify()

    def fail_calls(self, message: str) -> None:
        """The driver stopped: fail every call it will never run (after `stop`, so none is queued later)."""
        with self.lock:
            calls = [m for m in list(self._queue) if isinstance(m, _Call)]  # list(): one step under the GIL
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(EngineDeadError(message))

    def stop(self) -> None:
        """Refuse later aborts and ends (the streams are closed by now) and wake the driver, which exits."""
        self.stopping = True
        self.notify()

    def notify(self) -> None:
        """Wake the driver (a message, a stop, or news of its own, such as a failure between steps)."""
        with self._cond:
            self._cond.notify()

    # ------------------------------------------------------------------ the driver's thread
    def wait(self, ready: Callable[[], bool]) -> None:
        """Sleep until a message is queued, `stop` was asked, or `ready()` holds (checked on every wake-up)."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self.stopping or ready())

    def pause(self, seconds: float) -> None:
        """Sleep `seconds`, or until woken sooner."""
        with self._cond:
            self._cond.wait(seconds)

    def drain(
        self,
        admit: Callable[[Request], RequestDelta | None],
        abort: Callable[[str], list[RequestDelta]],
        outputs: list[RequestDelta],
    ) -> None:
        """Apply the queued messages in arrival order, those of live requests only: `admit(request)` and
        `abort(request_id)` hand them to the core; the final outputs they return (an abort's, one per sample
        still running; a refused admission's) and those of `end` join `outputs`."""
        queue, is_live = self._queue, self._router.is_live
        while queue:
            message = queue.popleft()
            if isinstance(message, _Call):
                message.run()
                continue
            slot = message.slot
            if not is_live(slot):
                continue  # finished or never admitted (an abort is a no-op), or failed or shut down meanwhile
            if isinstance(message, _Add):
                delta = admit(message.request)
            elif isinstance(message, _End):
                delta = message.delta
            else:
                outputs += abort(slot.request_id)
                continue
            if delta is not None:
                outputs.append(delta)
