"""How `asyncllm serve` stops on a signal: SIGTERM drains; a second SIGTERM, or Ctrl-C, stops at once.

Left to itself, uvicorn closes its listening sockets at the first SIGTERM (clients of a load balancer that
has not noticed yet get connection errors), then waits without limit for open connections, a stream
included, until a second Ctrl-C cancels the handlers mid-stream (tracebacks, streams cut without
`data: [DONE]`); and it re-raises the signal once stopped (a SIGTERM then exits 143). `DrainingServer` takes
SIGINT and SIGTERM itself and re-raises nothing (the process exits 0). Knows nothing of endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from asyncllm.server.listen import Server
from asyncllm.server.state import ServerState

logger = logging.getLogger("uvicorn.error")  # uvicorn's own log: its format, its --log-level

_TICK_S = 0.05  # how often the watcher reads the signal handler's flags
# A stop at once: how long the aborted streams have to send their last chunk and [DONE] (an abort lands
# within a step) before the connections still open are dropped (a client that stopped reading, say).
_STOP_GRACE_S = 1.0


class DrainingServer(Server):
    """uvicorn's server with asyncllm's signals. SIGTERM drains: it keeps listening and drains the engine
    (`AsyncLLMEngine.drain`: new requests and /health answer 503, streams run on for up to the drain
    timeout, then what is left is aborted), then uvicorn shuts down as usual. A second SIGTERM, or Ctrl-C
    (draining or not), stops at once: every live request is aborted, so each open stream ends with a
    final "abort" chunk and `data: [DONE]`, and uvicorn shuts down; connections still open `_STOP_GRACE_S`
    later are dropped. Either way the server closes the engine last, still under its own handlers."""

    def __init__(
        self, config: uvicorn.Config, on_started: Callable[[], None], state: ServerState, drain_timeout: float
    ) -> None:
        super().__init__(config, on_started)
        self._state = state
        self._drain_timeout = drain_timeout
        # Set by the signal handler, acted on by the watcher (a task on the loop).
        self._drain_asked = False
        self._stop_asked: str | None = None  # the name of the signal that asked to stop at once
        self._draining: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The handler uvicorn installs for SIGINT and SIGTERM: only flags here (the watcher acts on them
        within `_TICK_S`). Never uvicorn's own, which re-raises the signal once the server stopped."""
        if not self.started:
            self.should_exit = True  # nothing in flight yet: uvicorn stops as soon as it has started
        elif sig == signal.SIGTERM and not self._drain_asked and not self.should_exit:
            self._drain_asked = True
        elif self._stop_asked is None:
            self._stop_asked = signal.Signals(sig).name

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._watcher = asyncio.create_task(self._watch())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown (stop listening, wait for the connections), then the engine's: a signal during
        the engine's close is a flag here, where after `run` it would be a KeyboardInterrupt halfway."""
        try:
            await super().shutdown(sockets)
        finally:
            if self._watcher is not None:
                self._watcher.cancel()
        if self._state.engine is not None:
            await self._state.engine.aclose()

    async def _watch(self) -> None:
        while self._stop_asked is None:
            if self._drain_asked and self._draining is None:
                self._draining = asyncio.create_task(self._drain())
            await asyncio.sleep(_TICK_S)
        await self._stop_now(self._stop_asked)

    async def _drain(self) -> None:
        engine = self._state.engine
        try:
            if engine is not None:
                timeout = self._drain_timeout
                logger.warning(
                    "asyncllm: SIGTERM: draining: %d requests in flight may finish within %g s; new requests get 503",
                    engine.num_live_requests,
                    timeout,
                )
                aborted = await engine.drain(timeout)
                outcome = f"{aborted} requests aborted at the timeout" if aborted else "every request finished"
                logger.warning("asyncllm: drained (%s); shutting down", outcome)
        finally:
            self.should_exit = True  # whatever happened, the SIGTERM ends the server

    async def _stop_now(self, signal_name: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _STOP_GRACE_S
        if self._draining is not None:
            self._draining.cancel()  # the drain's refusal of new requests stays (`drain` below keeps it too)
        self.should_exit = True  # uvicorn stops listening at its next tick, then waits for the connections
        engine = self._state.engine
        if engine is not None:
            logger.warning(
                "asyncllm: %s: stopping at once: %d requests in flight aborted", signal_name, engine.num_live_requests
            )
            with contextlib.suppress(asyncio.TimeoutError):  # the builtin TimeoutError only from Python 3.11
                # Aborts every live request: each stream ends with "abort" and [DONE].
                await asyncio.wait_for(engine.drain(0), deadline - loop.time())
        else:
            logger.warning("asyncllm: %s: stopping at once", signal_name)
        state = self.server_state
        if await _until(lambda: not state.connections, deadline):
            return  # uvicorn's shutdown goes on as usual
        logger.warning(
            "asyncllm: %d connections still open %g s after the stop: dropped", len(state.connections), _STOP_GRACE_S
        )
        for connection in list(state.connections):
            connection.transport.abort()  # its handler hears the client leave, and returns
        if not await _until(lambda: not state.tasks, loop.time() + _STOP_GRACE_S):
            # uvicorn would wait for it without limit: a handler still running is cancelled as the loop closes
            self.force_exit = True


async def _until(condition: Callable[[], bool], deadline: float) -> bool:
    """Whether `condition()` held by `deadline` (the running loop's time), checked every `_TICK_S`."""
    loop = asyncio.get_running_loop()
    while not condition():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(_TICK_S)
    return True
