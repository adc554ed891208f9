"""One replica as the pool's front sees it: its actor, whether it may be routed to, and its life.

A thread per replica starts the actor (build the engine, then open its output stream: a Ray streaming
generator), marks it ready, and hands every batch it streams to the pool; when the stream breaks (the
actor's process died) or says the engine died, the pool ends that replica's streams, and the thread asks
Ray for a fresh actor in the same place, routed to only once its engine is built. The first start's
outcome is what the pool's constructor waits for. Knows nothing of routing or of event loops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import ray
from ray.exceptions import RayError

from asyncllm.async_engine.inproc_client import Built
from asyncllm.ray.wire import Batch, Message, ReplicaInfo

logger = logging.getLogger("asyncllm.ray")

_RESTART_BACKOFF_S = (0.5, 30.0)  # the pause before a replacement after failed starts: doubling, capped
_STOP_S = 10.0  # how long a stopping replica may take to release its device before its actor is killed


class Owner(Protocol):
    """What a replica reports to its pool (all from the replica's own thread)."""

    def on_ready(self, replica: Replica) -> None: ...
    def on_batch(self, replica: Replica, batch: Batch) -> None: ...
    def on_death(self, replica: Replica, message: str, cause: BaseException | None) -> None: ...
    def on_gone(self, replica: Replica, cause: BaseException | None) -> None: ...


class Replica:
    """Fields under the pool's `lock`: `ready`, `incarnation`, `requests`, the actor and its message count;
    the rest are the replica thread's, read by others as snapshots."""

    def __init__(
        self,
        index: int,
        spawn: Callable[[], Any],
        build: Callable[[], Built],
        owner: Owner,
        lock: threading.Lock,
        max_restarts: int,
    ) -> None:
        self.index = index
        self._spawn = spawn
        self._build = build
        self._owner = owner
        self._lock = lock
        self.max_restarts = max_restarts  # -1: no bound
        self.ready = False  # routable: its engine is built and its output stream open
        self.gone = False  # failed for good (restarts spent): never routed to again
        self.incarnation = 0  # which actor: messages placed for an earlier one are never sent to a later one
        self.requests: dict[str, int] = {}  # live requests routed here -> their number of samples
        self.restarts = 0
        self.info: ReplicaInfo | None = None  # the latest start's
        self.stats: dict[str, float | int] = {}  # the latest batch's
        self.busy = False
        self.last_batch_at = 0.0  # time.monotonic() when the latest batch arrived
        self._actor: Any = None
        self._seq = 0  # the next message batch's number (the actor applies them in this order)
        self._sent: list[Any] = []  # refs of message batches in flight (read back, so no error goes unhandled)
        self._first = threading.Event()
        self._first_outcome: ReplicaInfo | BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"asyncllm-replica-{index}", daemon=True)

    # ------------------------------------------------------------------ the pool's side
    def begin(self) -> None:
        self._thread.start()

    def first_outcome(self, timeout: float | None) -> ReplicaInfo | BaseException | None:
        """The first start's outcome: its facts, or its load error; None if still starting after `timeout`."""
        if not self._first.wait(timeout):
            return None
        return self._first_outcome or RuntimeError(f"replica {self.index} stopped before it started")

    def send(self, incarnation: int, messages: list[Message]) -> None:
        """Sender thread only: one batch, to the actor it was placed for (dropped if that one died: its
        requests were ended then)."""
        with self._lock:
            if not self.ready or incarnation != self.incarnation:
                return
            actor, seq = self._actor, self._seq
            self._seq += 1
        self._sent.append(actor.submit.remote(seq, messages))  # in `seq` order: one thread sends
        if len(self._sent) >= 64:
            self.reap()

    def reap(self) -> None:
        """Sender thread: read back the batches delivered (a failed one means the actor died: its thread
        learns that from the output stream)."""
        if not self._sent:
            return
        done, self._sent = ray.wait(self._sent, num_returns=len(self._sent), timeout=0)
        for ref in done:
            with contextlib.suppress(RayError):
                ray.get(ref)

    def stop(self) -> Any:
        """Ask the engine to shut down; returns the call's ref (None if there is no actor)."""
        self._stopping.set()
        actor = self._actor
        return None if actor is None else actor.stop.remote(_STOP_S)

    def kill(self, join_timeout: float) -> None:
        """End the actor for good and wait for the thread."""
        self._stopping.set()
        if self._actor is not None:
            ray.kill(self._actor, no_restart=True)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(join_timeout)

    @property
    def actor(self) -> Any:
        """The current actor (None between one and its replacement)."""
        return self._actor

    @property
    def pid(self) -> int | None:
        return self.info.pid if self.info is not None else None

    # ------------------------------------------------------------------ the replica's thread
    def _run(self) -> None:
        pause = 0.0  # before a replacement: none after a replica that served; doubling after failed starts
        cause: BaseException | None = None
        try:
            while not self._stopping.is_set():
                outcome = self._launch()
                if self._stopping.is_set():
                    return
                if not self._first.is_set():
                    self._first_outcome = outcome if isinstance(outcome, BaseException) else outcome[0]
                    self._first.set()
                    if isinstance(outcome, BaseException):
                        return  # the pool's constructor raises it
                if isinstance(outcome, BaseException):
                    cause = outcome
                    pause = min(max(2 * pause, _RESTART_BACKOFF_S[0]), _RESTART_BACKOFF_S[1])
                    logger.error("asyncllm: replica %d failed to start again: %r", self.index, outcome)
                else:
                    pause = 0.0
                    self.info = outcome[0]
                    self.stats, self.busy = self.info.stats, False
                    self._owner.on_ready(self)
                    message, cause = self._receive(outcome[1])
                    if self._stopping.is_set():
                        return
                    logger.error("asyncllm: replica %d: %s (%r)", self.index, message, cause)
                    self._owner.on_death(self, message, cause)
                self._discard_actor()
                if self.max_restarts >= 0 and self.restarts >= self.max_restarts:
                    break
                self.restarts += 1
                if self._stopping.wait(pause):
                    return
            if not self._stopping.is_set():
                self.gone = True
                self._owner.on_gone(self, cause)
        except BaseException as exc:  # a bug here must not leave the replica's streams hanging
            logger.exception("asyncllm: replica %d's thread failed", self.index)
            if not self._first.is_set():
                self._first_outcome = exc
            self.gone = True
            self._owner.on_gone(self, exc)
        finally:
            self._first.set()

    def _launch(self) -> tuple[ReplicaInfo, Any] | BaseException:
        """A fresh actor with its engine built and its output stream open, or why not."""
        actor = self._spawn()
        with self._lock:  # not ready yet: nothing is sent to it before `on_ready`
            self._actor, self._seq = actor, 0
        try:
            info = ray.get(actor.start.remote(self._build))
        except RayError as exc:  # the actor died while loading (killed, out of memory, ...)
            return exc
        if isinstance(info, BaseException):
            return info
        stream = actor.outputs.options(num_returns="streaming").remote()
        return info, stream

    def _receive(self, stream: Any) -> tuple[str, BaseException | None]:
        """Hand the pool every batch until the stream ends; why it ended."""
        try:
            for ref in stream:
                batch: Batch = ray.get(ref)
                self.stats, self.busy, self.last_batch_at = batch.stats, batch.busy, time.monotonic()
                self._owner.on_batch(self, batch)
                if batch.dead is not None:
                    message, cause = batch.dead
                    return f"its engine died: {message}", cause
        except RayError as exc:
            return "its process died", exc
        return "its output stream ended", None

    def _discard_actor(self) -> None:
        with self._lock:
            actor, self._actor = self._actor, None
        if actor is not None:
            ray.kill(actor, no_restart=True)  # it may live on with a dead engine: its device is needed again
