"""The in-process engine-core client: one step thread builds and drives the engine core (and so owns the device).

The first `EngineCoreClient`. The step thread builds the core, then loops: drain the inbox, step the core
(draining the inbox again right after the forward pass, so a request aborted mid-step gets no token from it
and its blocks are freed once, by the core), and route the step's outputs; it sleeps on the inbox when
there is no work. A failure kills the engine: the router ends every live stream with `EngineDeadError`,
cause chained; one request's own failure (a final delta with `error`) ends that stream alone. Knows
nothing of event loops: the router holds them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generic, Protocol

from asyncllm.async_engine.core_client import CoreInfo
from asyncllm.async_engine.inbox import Inbox
from asyncllm.async_engine.router import S, StepRouter
from asyncllm.core.output_processor import RequestDelta
from asyncllm.errors import InvalidRequestError, RequestFailedError

if TYPE_CHECKING:
    from asyncllm.core.engine_core import EngineCore
    from asyncllm.core.request import Request

logger = logging.getLogger(__name__)

_IDLE_RECHECK_S = 0.001  # pause when the core has requests yet scheduled nothing (no hot spin)
_SIGNAL_RECHECK_S = 0.1  # the longest a Ctrl-C during the load waits to be noticed


class Built(CoreInfo, Protocol):
    """What the step thread needs from `asyncllm.build.BuiltEngine` (or a test's stand-in): the core, and
    what its front needs to know of it."""

    @property
    def core(self) -> EngineCore: ...


class InProcClient(Generic[S]):
    """`EngineCoreClient` over a core that `build()` makes in the client's own step thread. `S`: the
    router's handle on a request's output (the front's `OutputSlot`; a ticket behind a Ray actor)."""

    def __init__(self, build: Callable[[], Built], router: StepRouter[S]) -> None:
        self._build = build
        self._router = router
        self._inbox: Inbox[S] = Inbox(router)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.failure: BaseException | None = None  # what killed the loop (None: running, or shut down)
        self._failed_between_steps: BaseException | None = None  # reported by the executor, from any thread
        self._built: Built | None = None
        self._core: EngineCore | None = None
        self._outputs: list[RequestDelta] = []  # the current step's outputs (step thread only)
        self._stats: dict[str, float | int] = {}  # replaced (never mutated) after every step
        self.step_started: float | None = None  # time.monotonic() when the step in flight began, else None
        self._thread = threading.Thread(target=self._run, name="asyncllm-step", daemon=True)

    # ------------------------------------------------------------------ any thread
    @property
    def lock(self) -> threading.RLock:
        return self._inbox.lock

    def start(self) -> Built:
        """Start the thread, wait until the core is built, and re-raise a load error here."""
        try:
            self._thread.start()
            # In slices: a Ctrl-C that the kernel delivered to another thread wakes no wait; Python runs its
            # handler (KeyboardInterrupt) in this thread at the next slice.
            while not self._ready.wait(_SIGNAL_RECHECK_S):
                pass
        except BaseException:  # Ctrl-C while loading: the thread releases what it built once the build returns
            self.request_stop()
            raise
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error
        assert self._built is not None
        return self._built

    def add_request(self, request: Request, slot: S) -> None:
        self._inbox.add(request, slot)

    def abort_request(self, slot: S) -> None:
        self._inbox.abort(slot)

    def end_request(self, slot: S, delta: RequestDelta) -> None:
        self._inbox.end(slot, delta)

    def stats(self) -> dict[str, float | int]:
        return dict(self._stats)

    def add_lora(self, name: str, path: str) -> Future[None]:
        future: Future[None] = Future()
        self._inbox.call(lambda: self._started_core().add_lora(name, path), future)
        return future

    def remove_lora(self, name: str) -> Future[None]:
        future: Future[None] = Future()
        self._inbox.call(lambda: self._started_core().remove_lora(name), future)
        return future

    def _started_core(self) -> EngineCore:
        assert self._core is not None, "a call before the core was built"
        return self._core

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def request_stop(self) -> None:
        """The thread stops after the step in flight and releases the device as it exits."""
        self._router.close("engine shut down", None)
        self._inbox.stop()

    def shutdown(self, timeout: float | None = None) -> None:
        """`request_stop`, then join the thread (never from the step thread itself)."""
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

    # ------------------------------------------------------------------ the step thread
    def _run(self) -> None:
        try:
            built = self._build()
            self._stats = built.core.stats().as_dict()
            built.core.watch_failure(self._fail_between_steps)
            self._built, self._core = built, built.core
        except BaseException as exc:  # every load failure goes back to the constructor, whatever it is
            self._load_error = exc
            self._router.close("engine failed to load", exc)
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
            self._inbox.stop()
            self._inbox.fail_calls("the engine stopped before it could run this call")
            self._router.close(f"engine step loop failed: {cause!r}", cause)  # no-op after shutdown closed it
            try:
                core.shutdown()
            except Exception:
                logger.exception("asyncllm: releasing the engine core failed")

    def _fail_between_steps(self, error: BaseException) -> None:
        """The executor failed outside a step (a worker died while idle): the engine dies now, not at the
        next request, so health checks and idle streams learn of it at once."""
        self._failed_between_steps = error
        self._inbox.notify()

    def _serve(self, core: EngineCore) -> None:
        inbox = self._inbox

        idle_work = core.graphs_pending > 0  # lazy capture's graphs, captured one at a time while nothing runs

        def has_work() -> bool:
            return core.has_unfinished() or self._failed_between_steps is not None or idle_work

        while True:
            inbox.wait(has_work)
            if inbox.stopping:
                return
            if self._failed_between_steps is not None:
                raise self._failed_between_steps
            self._outputs = []
            self._drain()
            if core.has_unfinished():
                self.step_started = time.monotonic()  # real time, whatever clock the core was given
                self._outputs.extend(core.step(after_execute=self._drain))  # mid-step aborts first
                self.step_started = None
                self._router.started(core.last_started)
                idle = core.last_step_idle
            else:
                idle = False
                if idle_work and not self._outputs:  # those go out first; a request sent meanwhile waits for
                    idle_work = core.idle_work()  # one capture at most (tens of milliseconds)
            self._stats = core.stats().as_dict()  # before routing: a finished stream sees its blocks freed
            for slot in self._router.route(self._outputs):  # their event loop is closed: stop computing them
                self.abort_request(slot)
            if idle:  # e.g. the head of the queue waits for memory; do not spin on it
                inbox.pause(_IDLE_RECHECK_S)

    def _drain(self) -> None:
        """Apply queued adds and aborts in arrival order; their final outputs join the current step's."""
        assert self._core is not None
        self._inbox.drain(self._admit, self._core.abort, self._outputs)

    def _admit(self, request: Request) -> RequestDelta | None:
        assert self._core is not None
        core = self._core
        try:
            core.add_request(request)
        except Exception as exc:  # this request's own state could not be built: it fails alone
            logger.warning("asyncllm: request %r could not be admitted", request.request_id, exc_info=exc)
            undone = core.abort_request(request.request_id)  # whatever part of it the core took
            metrics = undone.metrics if undone is not None else None
            error: str | RequestFailedError = str(exc)  # the core's own complaint about this request
            if not isinstance(exc, InvalidRequestError):  # the engine's failure, not the caller's
                error = RequestFailedError(f"the engine failed to admit this request: {exc!r}")
                error.__cause__ = exc
            return RequestDelta(request.request_id, [], "", "abort", metrics, error=error)
        return None
