"""Graceful drain on SIGTERM for `asyncllm serve`: finish what runs, refuse what comes, then exit.

Left to itself, uvicorn closes its listening sockets at the first SIGTERM, so clients of a load balancer
that has not noticed yet get connection errors instead of an answer. `DrainingServer` keeps listening: it
drains the engine (`AsyncLLMEngine.drain`: new requests and /health answer 503, streams run on for up to
the drain timeout, then what is left is aborted) and only then lets uvicorn shut down as usual (the
lifespan closes the engine). A second SIGTERM, or Ctrl-C, shuts down at once. Knows nothing of endpoints.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from asyncllm.server.listen import Server
from asyncllm.server.state import ServerState

logger = logging.getLogger("uvicorn.error")  # uvicorn's own log: its format, its --log-level


class DrainingServer(Server):
    def __init__(
        self, config: uvicorn.Config, on_started: Callable[[], None], state: ServerState, drain_timeout: float
    ) -> None:
        super().__init__(config, on_started)
        self._state = state
        self._drain_timeout = drain_timeout
        self._drain_asked = False  # set by the signal handler, acted on by the loop (`on_tick`)
        self._draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal handler: only a flag here (the loop starts the drain at its next tick, within 0.1 s)."""
        if sig == signal.SIGTERM and self.started and not self._drain_asked and not self.should_exit:
            self._drain_asked = True
            return
        super().handle_exit(sig, frame)  # while starting, a second SIGTERM, Ctrl-C: uvicorn's own way

    async def on_tick(self, counter: int) -> bool:
        if self._drain_asked and self._draining is None:
            self._draining = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

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
