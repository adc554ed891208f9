"""`Worker`: owns one device. Its set-up runs in steps, each one method: resolve the device and dtype, load
the model, size the KV cache (profiling memory on CUDA), allocate it with the input buffers, then run
steps through its `ModelRunner`. Later: capture CUDA graphs, and run as a tensor-parallel rank.

Knows nothing of requests or scheduling; the executor drives it.
"""

from __future__ import annotations

import logging

import torch

from asyncllm.attention.registry import make_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.executor.interface import ModelRunnerOutput, RuntimeInfo, SchedulerOutput
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.loader import load_model
from asyncllm.models.config import ModelArchConfig
from asyncllm.worker.device import resolve_device, resolve_dtype
from asyncllm.worker.input_batch import InputBuffers
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache, blocks_for_budget
from asyncllm.worker.memory import profile_kv_budget_bytes
from asyncllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint) -> None:
        self.config = config
        self.checkpoint = checkpoint
        self.device = resolve_device(config.device_config.device)
        self.dtype = resolve_dtype(config.model_config.dtype, self.device, checkpoint.hf_config)
        self.arch = ModelArchConfig.from_hf(checkpoint.hf_config, config.model_config.max_model_len)
        self.kv_spec = KVCacheSpec(
            num_layers=self.arch.num_layers,
            num_kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            block_size=config.cache_config.block_size,
            dtype=self.dtype,
        )
        self.runner: ModelRunner | None = None

    def load_model(self) -> None:
        self.backend = make_attention_backend(
            self.config.device_config.attention_backend, self.device, self.dtype, self.arch.num_kv_heads
        )
        mc = self.config.model_config
        self.model = load_model(
            self.checkpoint, self.arch, self.backend, self.device, self.dtype, mc.load_format, mc.seed
        )

    def determine_num_blocks(self) -> int:
        """The KV block count: the explicit `num_kv_blocks`, else what memory allows, capped at what
        `max_num_seqs` full-length sequences could ever use."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        max_model_len = self.arch.max_model_len
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        max_useful = sched.max_num_seqs * -(-max_model_len // cache.block_size)
        if self.device.type == "cpu":
            return blocks_for_budget(self.kv_spec, int(cache.cpu_kv_cache_gib * 2**30), max_useful)
        budget = profile_kv_budget_bytes(
            self.model,
            self.backend,
            self.kv_spec,
            self.device,
            vocab_size=self.arch.vocab_size,
            max_num_tokens=min(sched.max_num_batched_tokens, max_model_len),
            max_num_seqs=sched.max_num_seqs,
            gpu_memory_utilization=cache.gpu_memory_utilization,
        )
        return blocks_for_budget(self.kv_spec, budget, max_useful)

    def init_kv_cache(self, num_blocks: int) -> RuntimeInfo:
        """Allocate the cache and the step's input buffers; returns what the engine core needs to know."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        max_model_len = self.arch.max_model_len
        if num_blocks * cache.block_size < max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: longer requests are refused and "
                "outputs stop ('length') when a sequence fills it; raise num_kv_blocks (or GPU memory) to avoid it",
                num_blocks * cache.block_size,
                max_model_len,
            )
        kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        max_blocks_per_seq = -(-min(max_model_len, num_blocks * cache.block_size) // cache.block_size)
        buffers = InputBuffers(
            sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks_per_seq, cache.block_size, self.device
        )
        eos = self.checkpoint.eos_token_ids
        self.runner = ModelRunner(self.model, self.backend, kv_caches, buffers, self.device, eos)
        logger.info("KV cache: %d blocks of %d tokens (%s, %s)", num_blocks, cache.block_size, self.device, self.dtype)
        return RuntimeInfo(
            vocab_size=self.arch.vocab_size,
            max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            block_size=cache.block_size,
            eos_token_ids=eos,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.backend.name,
        )

    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "init_kv_cache comes before the first step"
        return self.runner.execute_model(scheduled)

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        self.__dict__.pop("model", None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
