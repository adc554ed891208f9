"""The record of one engine build: each phase timed in order (`Phases`, whose phases sum to the whole build),
and the banner that says what was built (`log_banner`: model, device, dtype, KV cache, limits, seconds per
phase) on the `asyncllm` logger. Plain Python over `RuntimeInfo` and `EngineConfig`; knows nothing of how
the phases run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator

from asyncllm.config import EngineConfig
from asyncllm.config_values import KVCacheDType
from asyncllm.step import RuntimeInfo

logger = logging.getLogger("asyncllm")


class Phases:
    """`with phases("open"): ...` times one phase; `record()` lists them, then `other` for the rest of the
    time since this object was made (so that the record covers the whole build, whatever was not named)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._seconds: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds.append((name, time.perf_counter() - start))

    def add(self, timed: Iterable[tuple[str, float]]) -> None:
        """Phases timed elsewhere (the worker's set-up steps), inside a phase of this record's."""
        self._seconds.extend(timed)

    def record(self) -> tuple[tuple[str, float], ...]:
        total = time.perf_counter() - self._start
        other = max(0.0, total - sum(seconds for _, seconds in self._seconds))
        return (*self._seconds, ("other", other))


def banner(config: EngineConfig, runtime: RuntimeInfo) -> list[str]:
    """The lines `log_banner` logs: what a user (or a bug report) needs to know of the engine just built."""
    seconds = runtime.startup_seconds
    total = sum(s for _, s in seconds)
    world = config.parallel_config.tensor_parallel_size
    architecture = f" ({runtime.architecture})" if runtime.architecture else ""
    graphs = (
        f"CUDA graphs for {len(runtime.cuda_graph_sizes)} decode batch sizes and "
        f"{len(runtime.cuda_graph_token_sizes)} token counts"
        if runtime.cuda_graph_sizes
        else "no CUDA graphs (eager)"
    )
    parallel = f", tensor_parallel_size {world}" if world > 1 else ""
    threads = ""
    if runtime.num_threads is not None and runtime.device == "cpu":
        threads = f", {runtime.num_threads} CPU thread{'s' if runtime.num_threads > 1 else ''}"
        threads += " per rank" if world > 1 else ""
    per_rank = " per rank" if world > 1 else ""
    size = f", {_size(runtime.kv_cache_bytes)}{per_rank}" if runtime.kv_cache_bytes else ""
    if config.cache_config.kv_cache_dtype is not KVCacheDType.AUTO:
        size += ", fp8 e4m3"
    sched = config.scheduler_config
    lora = config.lora_config
    loras = (
        [f"  LoRA: {runtime.max_loras} adapter slots, max_lora_rank {lora.max_lora_rank}"] if runtime.max_loras else []
    )
    pooler = runtime.pooler
    pooling = []
    if pooler is not None:  # what an embed or score engine computes (docs/embeddings.md)
        how = f"{pooler.score.value} scores" if pooler.score is not None else f"{pooler.method.value} pooling"
        pooling = [f"  task {runtime.task.value}: {how}, hidden size {pooler.hidden_size}"]
    return [
        f"engine ready in {total:.1f} s: {config.model}{architecture}",
        *pooling,
        f"  {runtime.device}, {runtime.dtype}, {runtime.attention_backend} attention, {graphs}{parallel}{threads}",
        f"  KV cache {runtime.kv_capacity_tokens:,} tokens ({runtime.num_kv_blocks:,} blocks of "
        f"{runtime.block_size}{size}); max_model_len {runtime.max_model_len:,}, max_num_seqs {sched.max_num_seqs}",
        *loras,
        "  start-up: " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds),
    ]


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 1000 * 2**20 else f"{num_bytes / 2**20:.1f} MiB"


def log_banner(config: EngineConfig, runtime: RuntimeInfo) -> None:
    for line in banner(config, runtime):
        logger.info("%s", line)
