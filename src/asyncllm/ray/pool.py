"""`ReplicaPool`: N engines as Ray actors behind the engine's own async API, for when one GPU (or one TP group)
is not enough.

It is an `AsyncLLMEngine` whose core client is `PoolClient`: the front is the single engine's (streams,
chat, n samples, cancellation within a step, any event loop, the server), the cores are replicas placed on a
Ray cluster. Ray is the optional extra `ray`; nothing imports it until a pool is made.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from asyncllm.async_engine.core_client import ClientFactory, EngineCoreClient
from asyncllm.async_engine.engine import AsyncLLMEngine
from asyncllm.async_engine.inproc_client import Built
from asyncllm.async_engine.router import OutputRouter
from asyncllm.config import EngineConfig, SchedulerConfig
from asyncllm.config_device import DEFAULT_GRAMMAR_COMPILE_TIMEOUT, DeviceConfig, device_limits
from asyncllm.errors import EngineDeadError, InvalidConfigError
from asyncllm.install import extra_install_hint
from asyncllm.validation import is_int, short_repr


class ReplicaPool(AsyncLLMEngine):
    """`ReplicaPool(model, num_replicas=2, ray_address=None, **engine_args)`: the engine's API over N replicas.

    ```
    async with ReplicaPool(path, num_replicas=2, device="cuda") as pool:
        async for chunk in pool.stream("Hello", SamplingParams(max_tokens=16)):
            print(chunk.text, end="")
    ```

    Each replica is a Ray actor holding one engine built from `model` and `engine_args` (one GPU, or
    `tensor_parallel_size` GPUs of one node). Requests go to the replica with the least outstanding work,
    unless one already holds the prompt's first KV block in its prefix cache (`asyncllm.ray.balancer`). The
    constructor returns once every replica has built its engine, and raises a replica's load error.

    `ray_address`: the cluster to join ("auto", "host:6379", "ray://host:10001"); None joins the one this
    process joined already, else $RAY_ADDRESS, else starts a local one. `ray_actor_options`: Ray actor options
    overriding each replica's reservation (by default one CPU, or its GPUs in a placement group on one
    node). `max_restarts`: how often a replica that died is replaced (-1: always).

    A replica that dies ends its own streams with `EngineDeadError` at once; the others carry on, and a fresh
    replica takes requests once its engine is built. `stats()` sums the ready replicas' (with
    `num_replicas`, `num_ready_replicas`, `num_replica_restarts`); `replica_stats()` has each one's.
    """

    def __init__(
        self,
        model: str,
        num_replicas: int = 2,
        ray_address: str | None = None,
        *,
        ray_actor_options: Mapping[str, Any] | None = None,
        max_restarts: int = -1,
        **engine_args: Any,
    ) -> None:
        config = EngineConfig.from_kwargs(model, **engine_args).resolved(streaming=True)  # bad ones raise here
        if config.lora_config.enable_lora:
            raise InvalidConfigError(
                "enable_lora=True is not supported by ReplicaPool yet (adapters would have to reach every replica, "
                "and each replacement): serve adapters from one AsyncLLMEngine"
            )
        if config.device_config.core_process:
            raise InvalidConfigError(
                "core_process=True is not supported by ReplicaPool: each replica's core already runs in a Ray "
                "actor of its own (leave core_process unset)"
            )
        from asyncllm.ray.actor import build_from_config

        self.config = config
        self._start_pool(
            functools.partial(build_from_config, config),
            _gpus_per_replica(config),
            num_replicas,
            ray_address,
            ray_actor_options,
            max_restarts,
            config.scheduler_config,
            config.device_config,
        )

    @classmethod
    def from_builder(
        cls,
        build: Callable[[], Built],
        *,
        clock: Callable[[], float] = time.monotonic,
        max_waiting_requests: int | None = None,
        max_step_seconds: float | None = None,
        grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
        num_replicas: int = 2,
        ray_address: str | None = None,
        ray_actor_options: Mapping[str, Any] | None = None,
        max_restarts: int = -1,
    ) -> ReplicaPool:
        """A pool whose replicas each run `build()` (pickled to them; it runs in the replica's step thread)
        for their core, on one CPU unless `ray_actor_options` says otherwise. For tests and benchmarks.
        `clock` times arrivals in this process; each replica's core must run on `time.monotonic` (arrivals
        are rebased on it there). The rest as in the constructor and `AsyncLLMEngine.from_builder`."""
        sched = SchedulerConfig(max_waiting_requests=max_waiting_requests)
        dev = device_limits(max_step_seconds, grammar_compile_timeout)
        pool = cls.__new__(cls)
        pool.config = None
        pool._start_pool(build, _no_gpus, num_replicas, ray_address, ray_actor_options, max_restarts, sched, dev, clock)
        return pool

    @classmethod
    def from_client(
        cls,
        make_client: ClientFactory,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_waiting_requests: int | None = None,
        max_step_seconds: float | None = None,
        grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
    ) -> AsyncLLMEngine:
        """Not for a pool, which makes its own client: use `AsyncLLMEngine.from_client`."""
        raise TypeError("ReplicaPool makes its own core client: use ReplicaPool(...) or ReplicaPool.from_builder(...)")

    def _start_pool(
        self,
        build: Callable[[], Built],
        gpus_per_replica: Callable[[], int],
        num_replicas: int,
        ray_address: str | None,
        ray_actor_options: Mapping[str, Any] | None,
        max_restarts: int,
        sched: SchedulerConfig,
        dev: DeviceConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not is_int(num_replicas) or num_replicas < 1:
            raise InvalidConfigError(f"num_replicas={short_repr(num_replicas)} is invalid: give an integer >= 1")
        if not is_int(max_restarts) or max_restarts < -1:
            raise InvalidConfigError(
                f"max_restarts={short_repr(max_restarts)} is invalid: give an integer >= 0, or -1 for no bound"
            )
        if ray_actor_options is not None and not isinstance(ray_actor_options, Mapping):
            raise InvalidConfigError(
                f"ray_actor_options={short_repr(ray_actor_options)} is invalid: give a dict of Ray actor options"
            )
        if ray_actor_options is not None and {"max_restarts", "max_task_retries"} & set(ray_actor_options):
            raise InvalidConfigError(
                "ray_actor_options may not set max_restarts or max_task_retries: the pool replaces replicas itself "
                "(ReplicaPool's own max_restarts)"
            )
        try:
            import ray  # noqa: F401 (the extra's presence, before anything starts)
        except ImportError as exc:
            raise ImportError(f"ReplicaPool needs Ray ({extra_install_hint('ray')})") from exc
        from asyncllm.ray.client import PoolClient, PoolSpec
        from asyncllm.ray.placement import connect, replica_spawns

        connect(ray_address)
        spawns, cleanup = replica_spawns(num_replicas, gpus_per_replica(), ray_actor_options)
        spec = PoolSpec(spawns, build, max_restarts, clock, cleanup)
        made: list[PoolClient] = []

        def make_client(router: OutputRouter) -> EngineCoreClient:
            made.append(PoolClient(spec, router))
            return made[0]

        self._start(make_client, clock, sched, dev)
        self._pool = made[0]

    # ------------------------------------------------------------------ introspection
    def replica_stats(self) -> list[dict[str, Any]]:
        """Per replica: `index`, `ready`, `restarts`, `pid` and `node_id` (of its current actor, None before
        one started), `num_outstanding` (requests routed there and not finished), and its engine's latest
        stats (those of `AsyncLLMEngine.stats`)."""
        rows = []
        for r in self._pool.replicas:
            info = r.info
            rows.append(
                {
                    **r.stats,
                    "index": r.index,
                    "ready": r.ready,
                    "restarts": r.restarts,
                    "pid": info.pid if info is not None else None,
                    "node_id": info.node_id if info is not None else None,
                    "num_outstanding": len(r.requests),
                }
            )
        return rows

    async def check_health(self, max_step_seconds: float | None = None) -> None:
        """As the engine's, and `EngineDeadError` while no replica is ready (all of them restarting)."""
        await super().check_health(max_step_seconds)
        if self._pool.num_ready == 0:
            raise EngineDeadError(f"no replica of the pool is ready ({len(self._pool.replicas)} restarting)")


def _gpus_per_replica(config: EngineConfig) -> Callable[[], int]:
    """GPUs each replica reserves: its TP group's on CUDA ("auto": when the cluster has GPUs), else none.
    Asked once connected to the cluster."""

    def gpus() -> int:
        from asyncllm.ray.placement import cluster_has_gpus

        device = config.device_config.device.value
        if device == "cuda" or (device == "auto" and cluster_has_gpus()):
            return config.parallel_config.tensor_parallel_size
        return 0

    return gpus


def _no_gpus() -> int:
    return 0
