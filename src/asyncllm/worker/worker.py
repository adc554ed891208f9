"""`Worker`: owns one device. Its set-up runs in steps, each one method, called in this order by the
executor: `load_model` (device, dtype, attention backend, weights, fused kernels), `determine_num_blocks`
(profiling memory on CUDA, CUDA graphs' share included), `init_kv_cache` (cache, input buffers, the
`ModelRunner`), `warm_up` (compiles every kernel), `capture_cuda_graphs`. Then it runs steps. As a
tensor-parallel rank (`parallel` given) it holds its shard of the model and of the KV heads; every rank
runs the same set-up and steps, in lock-step (the collectives inside the forward pass).

Knows nothing of requests or scheduling; the executor drives it.
"""

from __future__ import annotations

import logging
import time

import torch

from asyncllm.attention.registry import make_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.layers.fusion import use_fused_kernels
from asyncllm.layers.parallel import TPGroup
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.loader import load_model
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.tensor_parallel import shard_arch
from asyncllm.step import RuntimeInfo, SchedulerOutput, StepResult
from asyncllm.worker.cuda_graph import CudaGraphRunner, measure_graph_memory
from asyncllm.worker.device import resolve_device, resolve_dtype
from asyncllm.worker.gemm_layout import tune_weight_layouts
from asyncllm.worker.input_batch import InputBuffers
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache, blocks_for_budget
from asyncllm.worker.memory import profile_kv_budget_bytes
from asyncllm.worker.model_runner import ModelRunner
from asyncllm.worker.warmup import warm_up

# The graphs' pool is measured for the largest size only; the others share it but may fragment it a little.
_GRAPH_MEMORY_MARGIN = 1.25

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, parallel: TPGroup | None = None) -> None:
        self.config = config = config.resolved(streaming=False)  # a no-op for an engine's config (settled)
        self.checkpoint = checkpoint
        self.parallel = parallel
        self.device = resolve_device(config.device_config.device)
        self.dtype = resolve_dtype(config.model_config.dtype, self.device, checkpoint.hf_config)
        self.arch = ModelArchConfig.from_hf(checkpoint.hf_config, config.model_config.max_model_len)
        # This rank's share of the heads (the whole model without tensor parallelism): the KV cache's shape.
        self.local_arch = shard_arch(self.arch, 1 if parallel is None else parallel.world_size)
        self.kv_spec = KVCacheSpec(
            num_layers=self.arch.num_layers,
            num_kv_heads=self.local_arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            block_size=config.cache_config.block_size,
            dtype=self.dtype,
        )
        self.runner: ModelRunner | None = None
        self.num_blocks = 0
        self.timings: dict[str, float] = {}  # start-up seconds per step, reported in RuntimeInfo

    @property
    def use_cuda_graphs(self) -> bool:
        """Graphs on CUDA unless enforce_eager, with a backend that can be captured (Triton, not the torch
        reference, whose decode path plans on the host)."""
        return (
            self.device.type == "cuda"
            and not self.config.device_config.enforce_eager
            and self.backend.supports_cuda_graphs
        )

    @property
    def max_graph_tokens(self) -> int:
        """The largest step that is not decode-only to pad and plan statically (graphed on CUDA): also used
        eagerly with a backend that could be captured, so that `enforce_eager` computes the same numbers."""
        sched = self.config.scheduler_config
        graph_tokens = self.config.device_config.cuda_graph_max_tokens
        assert graph_tokens is not None, "EngineConfig.resolved settled it"
        return min(graph_tokens, sched.max_num_batched_tokens)

    def load_model(self) -> None:
        start = time.perf_counter()
        self.backend = make_attention_backend(
            self.config.device_config.attention_backend, self.device, self.dtype, self.local_arch.num_kv_heads
        )
        mc = self.config.model_config
        self.model = load_model(
            self.checkpoint, self.arch, self.backend, self.device, self.dtype, mc.load_format, mc.seed, self.parallel
        )
        # Our Triton backend brings the fused kernels with it (norm + residual, q/k norm + rotary + KV write,
        # SiLU-and-mul); the torch backend keeps every layer in its pure-PyTorch form, the reference.
        if self.backend.name == "triton":
            use_fused_kernels(self.model)
        self.timings["load"] = time.perf_counter() - start
        if self.device.type == "cuda" and not self.config.device_config.enforce_eager:
            start = time.perf_counter()
            transposed = tune_weight_layouts(self.model, self.device)
            self.timings["tune_gemm"] = time.perf_counter() - start
            logger.info("linear weights stored [in, out] for shapes %s", [s for s, t in transposed.items() if t])

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
        start = time.perf_counter()
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
        if self.use_cuda_graphs:
            graph_bytes = measure_graph_memory(
                self.model,
                self.backend,
                self.kv_spec,
                sched.max_num_seqs,
                sched.max_num_batched_tokens,
                self.max_graph_tokens,
                max_model_len,
                self.arch.hidden_size,
                self.dtype,
                self.device,
            )
            budget -= int(graph_bytes * _GRAPH_MEMORY_MARGIN)
            logger.info("CUDA graphs will hold about %.1f MiB", graph_bytes / 2**20)
        self.timings["profile"] = time.perf_counter() - start
        return blocks_for_budget(self.kv_spec, max(budget, 0), max_useful)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache and the step's input buffers, and the runner that uses them."""
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
        max_seq_len = min(max_model_len, num_blocks * cache.block_size)
        self.runner = ModelRunner(
            self.model,
            self.backend,
            kv_caches,
            buffers,
            self.device,
            eos,
            max_seq_len,
            self.arch.vocab_size,
            max_graph_tokens=self.max_graph_tokens,
        )
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%s, %s)", num_blocks, cache.block_size, self.device, self.dtype)

    def warm_up(self) -> None:
        """Compile every Triton kernel eager steps launch (CUDA only: on CPU nothing compiles)."""
        if self.device.type != "cuda":
            return
        assert self.runner is not None
        self.timings["warm_up"] = warm_up(
            self.runner,
            block_size=self.config.cache_config.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.arch.max_model_len,
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
            max_num_batched_tokens=self.config.scheduler_config.max_num_batched_tokens,
        )

    def capture_cuda_graphs(self) -> None:
        if not self.use_cuda_graphs:
            return
        runner = self.runner
        assert runner is not None
        graphs = CudaGraphRunner(
            self.model,
            self.backend,
            runner.kv_caches,
            runner.inputs,
            runner.max_seq_len,
            self.arch.hidden_size,
            self.dtype,
            self.device,
        )
        self.timings["capture"] = graphs.capture(runner.decode_sizes, runner.token_sizes)
        runner.graphs = graphs
        logger.info(
            "captured %d CUDA graphs in %.2f s: decode batch sizes %s, token counts %s",
            len(graphs.sizes) + len(graphs.token_sizes),
            self.timings["capture"],
            graphs.sizes,
            graphs.token_sizes,
        )

    def runtime_info(self) -> RuntimeInfo:
        """What the engine core needs to know, once set-up is done."""
        cache = self.config.cache_config
        return RuntimeInfo(
            vocab_size=self.arch.vocab_size,
            max_model_len=self.arch.max_model_len,
            num_kv_blocks=self.num_blocks,
            block_size=cache.block_size,
            eos_token_ids=self.checkpoint.eos_token_ids,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.backend.name,
            cuda_graph_sizes=tuple(self.runner.graphs.sizes) if self.runner and self.runner.graphs else (),
            cuda_graph_token_sizes=tuple(self.runner.graphs.token_sizes) if self.runner and self.runner.graphs else (),
            startup_seconds=tuple(self.timings.items()),
        )

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        assert self.runner is not None, "init_kv_cache comes before the first step"
        return self.runner.submit(scheduled)

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        self.__dict__.pop("model", None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
