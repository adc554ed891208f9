"""Where the replicas run: joining (or starting) the Ray cluster, and each replica's reservation on it.

A replica on GPUs reserves them through a placement group of one bundle, packed on one node: one GPU, or a
tensor-parallel group's GPUs, whose worker processes the engine starts itself inside that reservation (Ray
sets CUDA_VISIBLE_DEVICES to them). The group outlives its actor, so a replacement lands on the same
reservation. A CPU replica reserves one CPU. The tuning variables set here (`asyncllm.envs`) go with each
actor, whose process does not inherit this one's environment. `ray_actor_options` (Ray Serve's name)
overrides any of it. Knows nothing of engines or requests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncllm import envs
from asyncllm.ray.actor import ReplicaActor

logger = logging.getLogger("asyncllm.ray")


def connect(ray_address: str | None) -> None:
    """Join the cluster at `ray_address` ("auto", "host:6379", "ray://host:10001"; None: $RAY_ADDRESS, else
    a new local cluster), unless this process already joined one (`ray.init` called before): that one is used."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=ray_address)
    except ConnectionError as exc:
        where = ray_address or "$RAY_ADDRESS"
        raise ConnectionError(f"cannot join the Ray cluster at {where}: {exc}; check the address") from exc


def cluster_has_gpus() -> bool:
    return bool(ray.cluster_resources().get("GPU", 0))  # type: ignore[no-untyped-call]


def replica_spawns(
    num_replicas: int, gpus_per_replica: int, overrides: Mapping[str, Any] | None
) -> tuple[list[Callable[[], Any]], Callable[[], None]]:
    """One function per replica creating its actor, and the clean-up of their reservations."""
    actor_class = ray.remote(ReplicaActor)
    options: dict[str, Any] = {"num_cpus": 1, "num_gpus": gpus_per_replica, **(overrides or {})}
    options["max_restarts"] = 0  # the pool replaces a dead replica itself: it learns of the death at once
    tuning = {var.name: os.environ[var.name] for var in envs.ALL if os.environ.get(var.name, "").strip()}
    if tuning:  # the replicas build as an engine made here would; the options' own env_vars win
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**tuning, **runtime_env.get("env_vars", {})}
        options["runtime_env"] = runtime_env
    groups: list[PlacementGroup] = []
    if options["num_gpus"] and "scheduling_strategy" not in options:
        bundle = {k: float(v) for k, v in (("CPU", options["num_cpus"]), ("GPU", options["num_gpus"])) if v}
        groups = [placement_group([bundle], strategy="STRICT_PACK") for _ in range(num_replicas)]

    def spawn_in(group: PlacementGroup | None) -> Callable[[], Any]:
        placed = dict(options)
        if group is not None:
            placed["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        return lambda: actor_class.options(**placed).remote()

    spawns = [spawn_in(groups[i] if groups else None) for i in range(num_replicas)]

    def cleanup() -> None:
        for group in groups:
            try:
                remove_placement_group(group)
            except Exception as exc:  # the cluster went away first: nothing is left to release
                logger.warning("asyncllm: could not remove a replica's placement group: %r", exc)

    return spawns, cleanup
