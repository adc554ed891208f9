"""`attach_kv_tiers`: a worker's KV tiers below the device as `kv_offloading_size` and `kv_cache_dir` ask (the
host pool's size is the ranks' total, as vLLM's; the disk tier's directory is named by the engine's fingerprint
under `kv_cache_dir`), and their facts in its `RuntimeInfo` for the engine core (`step.KVTierInfo`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Protocol

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.errors import InvalidConfigError
from asyncllm.layers.parallel import TPGroup
from asyncllm.model_loader.base import Checkpoint
from asyncllm.step import KVTierInfo
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.kv_cache import KVCacheSpec
from asyncllm.worker.kv_disk import DiskKVStore
from asyncllm.worker.kv_fingerprint import kv_fingerprint
from asyncllm.worker.kv_host import HostKVPool
from asyncllm.worker.kv_tiers import WorkerKVTiers
from asyncllm.worker.model_runner import ModelRunner
from asyncllm.worker.worker import Worker

logger = logging.getLogger(__name__)

_STAGING_BYTES = 64 << 20  # the device's staging buffer: chunks of blocks cross through it (2 MiB DMAs or more)
_DISK_ONLY_HOST_GIB = 1.0  # the host pool a disk tier reads and writes through when kv_offloading_size is 0


class TierSetup(Protocol):
    """What `attach_kv_tiers` reads of the worker's set-up (`setup.WorkerSetup`)."""

    config: EngineConfig
    checkpoint: Checkpoint
    resolved: ResolvedModel
    parallel: TPGroup | None
    kv_spec: KVCacheSpec


def attach_kv_tiers(worker: Worker, setup: TierSetup) -> Worker:
    """`worker` with the KV tiers its config asks for (none: unchanged), and their facts in its runtime."""
    cache = setup.config.cache_config
    if cache.kv_offloading_size == 0 and cache.kv_cache_dir is None:
        return worker
    runner = worker.runner
    rank, world = (0, 1) if setup.parallel is None else (setup.parallel.rank, setup.parallel.world_size)
    # EngineConfig refuses tiers without prefix caching, and embed/score engines refuse them at start.
    assert cache.enable_prefix_caching and isinstance(runner, ModelRunner), "KV tiers without a prefix cache"
    block_bytes = setup.kv_spec.bytes_per_block
    gib = cache.kv_offloading_size or _DISK_ONLY_HOST_GIB
    num_slots = int(gib * 2**30 / world) // block_bytes  # the size is the ranks' total, as vLLM's
    if num_slots < 1:
        raise InvalidConfigError(
            f"kv_offloading_size={cache.kv_offloading_size} GiB holds no KV block ({block_bytes * world} bytes "
            "each): give more, or 0 to turn the host tier off"
        )
    device = setup.resolved.device
    # With a disk tier the slots are shared memory, which the reader process fills (kv_reader.py).
    reader_process = cache.kv_cache_dir is not None and envs.KV_DISK_READER.get() is envs.KvDiskReader.PROCESS
    pool = HostKVPool(runner.graphs.kv_caches, num_slots, device, _STAGING_BYTES, shared=reader_process)
    disk = None
    if cache.kv_cache_dir is not None:
        root = Path(cache.kv_cache_dir)
        fingerprint = kv_fingerprint(setup.checkpoint.path, _facts(setup, runner, rank, world))
        directory = root / fingerprint.hex()
        capacity = _disk_capacity(root, directory, world)
        disk = DiskKVStore(directory, fingerprint, pool, capacity, envs.KV_DISK_LOAD_THREADS.get(), reader_process)
    info = KVTierInfo(
        host_blocks=num_slots,
        ahead_blocks=envs.KV_OFFLOAD_AHEAD.get(),
        disk_blocks=disk.capacity_blocks if disk is not None else 0,
        loads_per_step=envs.KV_DISK_LOADS_PER_STEP.get(),
        restores_per_step=-(-(envs.KV_RESTORE_MIB_PER_STEP.get() << 20) // block_bytes),
        on_disk=disk.on_disk() if disk is not None else (),
    )
    if rank == 0:
        logger.info(
            "KV host tier: %d blocks (%.2f GiB%s)%s",
            num_slots,
            num_slots * block_bytes * world / 2**30,
            ", pinned" if device.type == "cuda" else "",
            f"; disk tier {disk.directory}: {len(info.on_disk)} blocks found, "
            f"read {'by a process of their own' if disk.reader_pid is not None else 'on threads'}"
            if disk is not None
            else "",
        )
    worker.kv_tiers = WorkerKVTiers(pool, disk, setup.parallel)
    worker.runtime = dataclasses.replace(worker.runtime, kv_tiers=info)
    return worker


def _facts(setup: TierSetup, runner: ModelRunner, rank: int, world: int) -> dict[str, object]:
    """What the KV depends on besides tokens and weights (`kv_fingerprint`)."""
    resolved, mc = setup.resolved, setup.config.model_config
    return {
        "arch": resolved.arch,
        "dtype": resolved.dtype,
        "kv_cache_dtype": resolved.kv_cache_dtype,
        "quant": resolved.quant,
        "kv_spec": setup.kv_spec,
        "device": resolved.device.type,
        "attention_backend": runner.backend.name,
        "rank": rank,
        "world": world,
        "load_format": str(getattr(mc.load_format, "value", mc.load_format)),
        "seed": mc.seed if str(getattr(mc.load_format, "value", mc.load_format)) == "dummy" else None,
    }


def _disk_capacity(root: Path, directory: Path, world: int) -> int:
    """This rank's share of ASYNCLLM_KV_DISK_GIB (auto: half the free space, plus what the tier holds)."""
    gib = envs.KV_DISK_GIB.get()
    if gib is not None:
        return int(gib * 2**30 / world)
    held = sum(p.stat().st_size for p in directory.glob("*.kvb")) if directory.is_dir() else 0
    return int((shutil.disk_usage(root).free + held) // 2 // world)
