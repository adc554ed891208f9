"""The step thread: the one thread that builds and drives the engine core (and so owns the device).

New requests and aborts enter through a thread-safe inbox, drained in order at the start of every step
and again right after the forward pass, so a request aborted mid-step gets no token from it and its blocks
are freed once, by the core. Outputs are routed to their streams' event loops; the thread sleeps on a
condition when there is no work. A failure kills the engine: every live stream gets `EngineDeadError`
with the cause chained; one request's own failure (a final delta with `error`) ends that stream alone.
Knows nothing of event loops beyond the fanout it hands outputs to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from asyncllm.async_engine.ids import LiveRequests
from asyncllm.async_engine.loop_fanout import LoopFanout
from asyncllm.async_engine.mailbox import OutputSlot
from asyncllm.core.output_processor import RequestDelta
from asyncllm.errors import EngineDeadError

if TYPE_CHECKING:
    from asyncllm.chat import ChatTokenizer
    from asyncllm.core.engine_core import EngineCore
    from asyncllm.core.request import Request
    from asyncllm.input_processor import Encode, EncodeBatch
    from asyncllm.step import RuntimeInfo

logger = logging.getLogger(__name__)

_IDLE_RECHECK_S = 0.001  # pause when the core has requests yet scheduled nothing (no hot spin)


class Built(Protocol):
    """What the step thread needs from `asyncllm.build.BuiltEngine` (or a test's stand-in)."""

    @property
    def core(self) -> EngineCore: ...
    @property
    def tokenizer(self) -> ChatTokenizer | None: ...
    @property
    def runtime(self) -> RuntimeInfo: ...
    @property
    def encode(self) -> Encode | None: ...
    @property
    def encode_batch(self) -> EncodeBatch | None: ...


class _Add(NamedTuple):
    request: Request
    slot: OutputSlot


class _Abort(NamedTuple):
    slot: OutputSlot  # which incarnation of the id: a stale abort never hits a later request reusing it


class _Final(NamedTuple):
    slot: OutputSlot  # a request that never reached the core (aborted or refused before): its last output
    delta: RequestDelta


class StepLoop:
    def __init__(self, build: Callable[[], Built], live: LiveRequests[OutputSlot], fanout: LoopFanout) -> None:
        self._build = build
        self._live = live
        self._fanout = fanout
        self._inbox: deque[_Add | _Abort | _Final] = deque()  # append/popleft are atomic: no lock to enqueue
        # Reentrant: a stream garbage-collected inside this thread's own locked region may enqueue an abort.
        # Admission shares it, for the same reason (see admission.py).
        self.lock = threading.RLock()
        self._cond = threading.Condition(self.lock)
        self._stopping = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.failure: BaseException | None = None  # what killed the loop (None: running, or shut down)
        self._failed_between_steps: BaseException | None = None  # reported by the executor, from any thread
        self._outputs: list[RequestDelta] = []  # the current step's outputs (step thread only)
        self.built: Built | None = None
        self.stats: dict[str, float | int] = {}  # replaced (never mutated) after every step
        self.step_started: float | None = None  # time.monotonic() when the step in flight began, else None
        self._thread = threading.Thread(target=self._run, name="asyncllm-step", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> Built:
        """Start the thread, wait until the core is built, and re-raise a load error here."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error
        assert self.built is not None
        return self.built

    def submit_add(self, request: Request, slot: OutputSlot) -> None:
        self._inbox.append(_Add(request, slot))
        self._notify()

    def submit_abort(self, slot: OutputSlot) -> None:
        """Synchronous and idempotent: an unknown, finished or already aborted request is a no-op."""
        if self._stopping:
            return
        self._inbox.append(_Abort(slot))
        self._notify()

    def submit_final(self, slot: OutputSlot, delta: RequestDelta) -> None:
        """The last output of a request that never reached the core, routed in inbox order."""
        if self._stopping:
            return
        self._inbox.append(_Final(slot, delta))
        self._notify()

    def request_stop(self) -> None:
        """End every live stream with EngineDeadError("engine shut down") and refuse new requests at once;
        the thread stops after the step in flight and releases the device as it exits. Never blocks."""
        self._close("engine shut down", None)
        self._stopping = True
        self._notify()

    def shutdown(self, timeout: float | None = None) -> None:
        """`request_stop`, then join the thread. Idempotent; safe from the step thread itself (no self-join)."""
        self.request_stop()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                if self.failure is not None:
                    logger.warning(
                        "asyncllm step thread still releasing the engine %.1f s after it died; left behind "
                        "(the device may stay held until this process exits)",
                        timeout,
                    )
                else:
                    logger.warning("asyncllm step thread still busy %.1f s after shutdown was asked", timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    def _close(self, message: str, cause: BaseException | None) -> None:
        def make_error() -> EngineDeadError:
            error = EngineDeadError(message)
            error.__cause__ = cause
            return error

        slots = self._live.close(make_error)
        self._fanout.fail(slots, message, cause)
        for slot in slots:
            self._fanout.detach(slot.mailbox)

    # ------------------------------------------------------------------ the step thread
    def _run(self) -> None:
        try:
            built = self._build()
            self.stats = built.core.stats().as_dict()
            built.core.watch_failure(self._fail_between_steps)
            self.built = built
        except BaseException as exc:  # every load failure goes back to the constructor, whatever it is
            self._load_error = exc
            self._close("engine failed to load", exc)
            return
        finally:
            self._ready.set()
        core = built.core
        cause: BaseException | None = None
        try:
            self._serve(core)
        except BaseException as exc:  # any failure of the loop kills the engine, never silently
            cause = self.failure = exc
            logger.error("asyncllm step loop failed; the engine is dead", exc_info=exc)
        finally:
            self._stopping = True
            self._close(f"engine step loop failed: {cause!r}", cause)  # no-op after shutdown closed it
            try:
                core.shutdown()
            except Exception:
                logger.exception("asyncllm: releasing the engine core failed")

    def _fail_between_steps(self, error: BaseException) -> None:
        """The executor failed outside a step (a worker died while idle): the engine dies now, not at the
        next request, so health checks and idle streams learn of it at once."""
        self._failed_between_steps = error
        self._notify()

    def _serve(self, core: EngineCore) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._inbox or self._stopping or core.has_unfinished() or self._failed_between_steps is not None
                    )
                )
            if self._stopping:
                return
            if self._failed_between_steps is not None:
                raise self._failed_between_steps
            self._outputs = []
            self._drain(core)
            if core.has_unfinished():
                self.step_started = time.monotonic()  # real time, whatever clock the core was given
                self._outputs.extend(core.step(after_execute=self._drain_mid_step))  # mid-step aborts first
                self.step_started = None
                idle = core.last_step_idle
            else:
                idle = False
            self.stats = core.stats().as_dict()  # before routing: a finished stream sees its blocks freed
            self._route(self._outputs)
            if idle:  # e.g. the head of the queue waits for memory; do not spin on it
                with self._cond:
                    self._cond.wait(_IDLE_RECHECK_S)

    def _drain(self, core: EngineCore) -> None:
        """Apply queued adds and aborts in arrival order; abort outputs join the current step's outputs."""
        inbox = self._inbox
        while inbox:
            message = inbox.popleft()
            if isinstance(message, _Add):
                if self._live.get(message.slot.request_id) is message.slot:  # else: failed or shut down meanwhile
                    self._admit(core, message.request)
                continue
            slot = message.slot
            if self._live.get(slot.request_id) is not slot:
                continue  # already finished (or never admitted): aborting is a no-op
            if isinstance(message, _Final):
                self._outputs.append(message.delta)
                continue
            delta = core.abort_request(slot.request_id)
            if delta is not None:
                self._outputs.append(delta)

    def _admit(self, core: EngineCore, request: Request) -> None:
        try:
            core.add_request(request)
        except Exception as exc:  # this request's own state could not be built: it fails alone
            logger.warning("asyncllm: request %r could not be admitted", request.request_id, exc_info=exc)
            undone = core.abort_request(request.request_id)  # whatever part of it the core took
            metrics = undone.metrics if undone is not None else None
            error = f"the engine could not admit this request: {exc!r}"
            self._outputs.append(RequestDelta(request.request_id, [], "", "abort", metrics, error=error))

    def _drain_mid_step(self) -> None:
        assert self.built is not None
        self._drain(self.built.core)

    def _route(self, deltas: list[RequestDelta]) -> None:
        if not deltas:
            return
        finished = [d.finish_reason is not None or d.error is not None for d in deltas]
        slots = self._live.resolve([d.request_id for d in deltas], finished)
        items = [(slot, delta) for slot, delta in zip(slots, deltas) if slot is not None]
        orphans = self._fanout.deliver(items)
        for slot, done in zip(slots, finished):
            if slot is not None and done:
                self._fanout.detach(slot.mailbox)
        for slot in orphans:  # their event loop is closed: nobody will read them, so stop computing them
            if not slot.finished:
                self.submit_abort(slot)
