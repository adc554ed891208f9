"""`PoolClient`: the `EngineCoreClient` over N replica actors, so the ordinary `AsyncLLMEngine` front drives a pool.

The front (tokenizing, admission, streams, chat, n samples, cancellation) is the single engine's, unchanged;
this client places each checked request on a replica (`Balancer`), sends every replica its adds and aborts
from one sender thread (one numbered Ray call per replica per wake-up, so the caller's thread only appends
to the inbox: an abort from a dying task never waits on Ray), and routes each replica's streamed batches
to the streams. A replica that dies ends its own requests with `EngineDeadError` and is replaced; the pool
is dead only once every replica is gone for good. Knows nothing of placement on the cluster.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError

from asyncllm.async_engine.inbox import Inbox
from asyncllm.async_engine.inproc_client import Built
from asyncllm.async_engine.mailbox import OutputSlot
from asyncllm.async_engine.router import OutputRouter, ends_request
from asyncllm.core.output_processor import RequestDelta
from asyncllm.core.request import Request
from asyncllm.errors import EngineDeadError, InvalidRequestError, LoRAError
from asyncllm.input_processor import CheckConstraint, Encode, EncodeBatch
from asyncllm.ray.balancer import Balancer
from asyncllm.ray.replica import Replica
from asyncllm.ray.wire import AbortRequest, AddRequest, Batch, Message, ReplicaInfo
from asyncllm.step import RuntimeInfo
from asyncllm.structured import StructuredOutput

logger = logging.getLogger("asyncllm.ray")

_START_NOTICE_S = 30.0  # a replica still starting after this long is logged (then again each period)
_STOP_ON_FAILED_START_S = 10.0  # after a failed start, how long the other replicas get to release their engines
_CONSTRAINT_CHECK_S = 60.0  # a compile on a replica taking longer fails that request, not the tokenizer thread
_SUMMED_OUT = frozenset({"prefix_cache_hit_rate"})  # stats recomputed from the replicas' sums, not summed


@dataclass(frozen=True)
class PoolSpec:
    """How to make each replica: `spawns[i]()` creates replica i's actor (in its placement), `build` runs
    inside it and builds the engine core."""

    spawns: Sequence[Callable[[], Any]]
    build: Callable[[], Built]
    max_restarts: int = -1  # per replica; -1: replaced however often it dies
    clock: Callable[[], float] = time.monotonic  # the front's, which request arrival times come from
    cleanup: Callable[[], None] = lambda: None  # after every actor is gone (placement groups)


@dataclass(frozen=True)
class FrontInfo:
    """`CoreInfo` for the front, from the replicas' own."""

    runtime: RuntimeInfo
    tokenizer: Any
    encode: Encode | None
    encode_batch: EncodeBatch | None
    check_constraint: CheckConstraint | None


class PoolClient:
    def __init__(self, spec: PoolSpec, router: OutputRouter) -> None:
        self._spec = spec
        self._router = router
        self._inbox: Inbox[OutputSlot] = Inbox(router)
        self._placement = threading.Lock()  # the balancer, `_placed`, and each replica's routing state
        self.replicas = [
            Replica(i, spawn, spec.build, self, self._placement, spec.max_restarts)
            for i, spawn in enumerate(spec.spawns)
        ]
        self._balancer = Balancer(len(self.replicas), 1)
        self._placed: dict[str, Replica] = {}  # live request id -> the replica holding it
        self._sender = threading.Thread(target=self._send_loop, name="asyncllm-pool-send", daemon=True)
        self._stopped = False
        self._released = False  # the replicas were stopped and their reservations removed
        self.failure: BaseException | None = None

    # ------------------------------------------------------------------ EngineCoreClient
    @property
    def lock(self) -> threading.RLock:
        return self._inbox.lock

    def start(self) -> FrontInfo:
        """Start every replica and wait until each has built its engine; a load error is raised here."""
        for replica in self.replicas:
            replica.begin()
        started = time.monotonic()
        outcomes: list[ReplicaInfo | BaseException] = []
        for replica in self.replicas:
            while (outcome := replica.first_outcome(_START_NOTICE_S)) is None:
                logger.warning(
                    "asyncllm: replica %d still starting after %.0f s (loading, or waiting for Ray to place it)",
                    replica.index,
                    time.monotonic() - started,
                )
            outcomes.append(outcome)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            self.shutdown(_STOP_ON_FAILED_START_S)
            raise failed[0]
        infos = [o for o in outcomes if isinstance(o, ReplicaInfo)]
        first = infos[0]
        # Replicas may size their KV caches differently (memory left on each device): check against the least.
        runtime = min((i.runtime for i in infos), key=lambda r: r.num_kv_blocks)
        with self._placement:
            self._balancer = Balancer(len(self.replicas), runtime.block_size)
        check = self._check_constraint if first.checks_constraints else None
        self._sender.start()
        return FrontInfo(runtime, first.tokenizer, first.encode, first.encode_batch, check)

    def add_request(self, request: Request, slot: OutputSlot) -> None:
        self._inbox.add(request, slot)

    def abort_request(self, slot: OutputSlot) -> None:
        self._inbox.abort(slot)

    def end_request(self, slot: OutputSlot, delta: RequestDelta) -> None:
        self._inbox.end(slot, delta)

    def add_lora(self, name: str, path: str) -> Future[None]:
        return self._no_lora()

    def remove_lora(self, name: str) -> Future[None]:
        return self._no_lora()

    @staticmethod
    def _no_lora() -> Future[None]:
        """The pool refuses `enable_lora` when it is made; a call reaching here fails as an engine without it."""
        future: Future[None] = Future()
        future.set_exception(LoRAError("LoRA adapters are not supported by ReplicaPool yet (enable_lora is refused)"))
        return future

    def stats(self) -> dict[str, float | int]:
        """The ready replicas' latest snapshots summed (the prefix-cache hit rate pooled from its terms), and
        `num_replicas`, `num_ready_replicas`, `num_replica_restarts`."""
        ready = [r.stats for r in self.replicas if r.ready]
        total: dict[str, float | int] = {}
        for stats in ready:
            for key, value in stats.items():
                if key not in _SUMMED_OUT:
                    total[key] = total.get(key, 0) + value
        queried = total.get("prefix_cache_queried_tokens", 0)
        total["prefix_cache_hit_rate"] = total.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
        total["num_replicas"] = len(self.replicas)
        total["num_ready_replicas"] = len(ready)
        total["num_replica_restarts"] = sum(r.restarts for r in self.replicas)
        return total

    @property
    def step_started(self) -> float | None:
        """When the oldest step in flight on a ready replica began, as the front sees it: the arrival of that
        replica's latest batch while it had work (None when no replica has)."""
        busy = [r.last_batch_at for r in self.replicas if r.ready and r.busy]
        return min(busy) if busy else None

    @property
    def is_alive(self) -> bool:
        return not self._stopped and self._sender.is_alive() and any(not r.gone for r in self.replicas)

    @property
    def num_ready(self) -> int:
        return sum(r.ready for r in self.replicas)

    def request_stop(self) -> None:
        self._stopped = True
        self._router.close("engine shut down", None)
        self._inbox.stop()

    def shutdown(self, timeout: float | None) -> None:
        """Stop every replica's engine (in parallel), then end its actor; then the placement groups.
        Idempotent; after Ray itself shut down (at interpreter exit) there is nothing left to release."""
        self.request_stop()
        if self._sender.is_alive() and threading.current_thread() is not self._sender:
            self._sender.join(timeout)
        if self._released or not ray.is_initialized():
            return
        self._released = True
        try:
            stops = [ref for ref in (r.stop() for r in self.replicas) if ref is not None]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=timeout)
            for replica in self.replicas:
                replica.kill(5.0)
        except RayError as exc:  # the cluster went away under us: its actors went with it
            logger.warning("asyncllm: stopping the replicas failed: %r", exc)
        self._spec.cleanup()

    # ------------------------------------------------------------------ the sender thread
    def _send_loop(self) -> None:
        inbox = self._inbox
        try:
            while True:
                inbox.wait(lambda: False)
                if inbox.stopping:
                    return
                outbound: dict[tuple[Replica, int], list[Message]] = {}
                ended: list[RequestDelta] = []
                inbox.drain(
                    functools.partial(self._place, outbound=outbound),
                    functools.partial(self._abort, outbound=outbound),
                    ended,
                )
                for (replica, incarnation), messages in outbound.items():
                    replica.send(incarnation, messages)
                if ended:
                    self._router.route(ended)  # final outputs: nothing of theirs is owed afterwards
                for replica in self.replicas:
                    replica.reap()
        except BaseException as exc:  # requests could no longer reach any replica: the pool is dead
            logger.exception("asyncllm: the pool's sender failed")
            self.failure = exc
            self._router.close(f"the replica pool's sender failed: {exc!r}", exc)

    def _place(self, request: Request, outbound: dict[tuple[Replica, int], list[Message]]) -> RequestDelta | None:
        rid, n = request.request_id, request.params.n
        with self._placement:
            choice = self._balancer.choose(request.prompt_token_ids, [r.ready for r in self.replicas])
            if choice is None:
                return RequestDelta(rid, [], "", "abort", None, error=self._no_replica())
            replica = self.replicas[choice]
            replica.requests[rid] = n
            self._balancer.load[choice] += n
            self._placed[rid] = replica
            incarnation = replica.incarnation
        waited = self._spec.clock() - request.arrival_time
        outbound.setdefault((replica, incarnation), []).append(AddRequest(request, waited))
        return None

    def _abort(self, request_id: str, outbound: dict[tuple[Replica, int], list[Message]]) -> list[RequestDelta]:
        """To the replica holding it; its final output ("abort") comes back with that replica's steps."""
        with self._placement:
            replica = self._placed.get(request_id)
            incarnation = replica.incarnation if replica is not None else 0
        if replica is not None:
            outbound.setdefault((replica, incarnation), []).append(AbortRequest(request_id))
        return []

    def _no_replica(self) -> EngineDeadError:
        restarting = sum(not r.gone for r in self.replicas)
        return EngineDeadError(
            f"no replica of the pool is ready ({restarting} of {len(self.replicas)} restarting); retry shortly"
        )

    def _check_constraint(self, structured: StructuredOutput) -> None:
        """Compiled on a ready replica (the one that serves the request compiles it again, cached there)."""
        with self._placement:
            actors = [r.actor for r in self.replicas if r.ready]
        if not actors:
            raise self._no_replica()
        error = ray.get(actors[0].check_constraint.remote(structured), timeout=_CONSTRAINT_CHECK_S)
        if error is not None:
            raise InvalidRequestError(error)

    # ------------------------------------------------------------------ Owner: each replica's thread
    def on_ready(self, replica: Replica) -> None:
        with self._placement:
            replica.incarnation += 1
            replica.ready = True
        if replica.restarts:
            logger.warning("asyncllm: replica %d is back (restart %d)", replica.index, replica.restarts)

    def on_batch(self, replica: Replica, batch: Batch) -> None:
        finished = [d.request_id for d in batch.deltas if ends_request(d)]
        if finished:  # before routing: once a stream has ended, its id may be reused at once
            with self._placement:
                for rid in finished:
                    self._unplace(replica, rid)
        self._router.started(batch.started)
        for slot in self._router.route(batch.deltas):  # their event loop is closed: stop computing them
            self.abort_request(slot)

    def on_death(self, replica: Replica, message: str, cause: BaseException | None) -> None:
        with self._placement:
            replica.ready = False
            lost = list(replica.requests)
            for rid in lost:
                self._unplace(replica, rid)
            self._balancer.forget(replica.index)
        error = EngineDeadError(f"replica {replica.index} of the pool failed: {message}")
        error.__cause__ = cause
        self._router.route([RequestDelta(rid, [], "", "abort", None, error=error) for rid in lost])

    def on_gone(self, replica: Replica, cause: BaseException | None) -> None:
        logger.error("asyncllm: replica %d is gone for good after %d restarts", replica.index, replica.restarts)
        if all(r.gone for r in self.replicas):
            self.failure = cause
            self._router.close(f"every replica of the pool failed: {cause!r}", cause)

    def _unplace(self, replica: Replica, rid: str) -> None:
        """Under the placement lock: `rid` left `replica`."""
        n = replica.requests.pop(rid, 0)
        self._balancer.load[replica.index] -= n
        if self._placed.get(rid) is replica:
            del self._placed[rid]
