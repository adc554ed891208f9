"""`build_worker`: the one way every executor and rank builds its `Worker`, in order, each step taking what
the one before returned: load the model (attention backend, weights, fused kernels, GEMM layouts), size the
KV cache (profiling memory on CUDA, the CUDA graphs' share included; the ranks agree on one count), allocate
it with the step's buffers and the runner, warm up (compiles every kernel), capture the CUDA graphs.

As a tensor-parallel rank (`parallel` given) the worker holds its shard of the model and of the KV heads;
every rank runs the same steps in the same order (each may run collectives). Knows nothing of requests, of
scheduling, or of how ranks are started.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from asyncllm.attention.backend import AttentionBackend
from asyncllm.attention.registry import make_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.envs import CascadeAttention, CudaGraphCapture, DecodeGemv
from asyncllm.layers.fusion import use_fused_kernels, use_pdl
from asyncllm.layers.parallel import TPGroup
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.loader import load_model
from asyncllm.models.base import CausalLM
from asyncllm.models.one_launch import use_one_launch_layers
from asyncllm.models.tensor_parallel import shard_arch
from asyncllm.step import RuntimeInfo
from asyncllm.structured_output.backend import GrammarBackend
from asyncllm.structured_output.grammar_table import GrammarProcessMode
from asyncllm.structured_output.matcher_set import MAX_FILL_THREADS
from asyncllm.worker.buckets import Buckets
from asyncllm.worker.cuda_graph import CudaGraphRunner
from asyncllm.worker.device import ResolvedModel, check_layer_prefetch, check_pdl
from asyncllm.worker.draft_setup import LoadedDraft, LoadedEagle3, draft_bytes, load_draft, make_draft_model
from asyncllm.worker.gemm_layout import gemv_layers, prologue_layers, set_decode_gemv, tune_linear_layers
from asyncllm.worker.input_batch import InputBuffers
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache, blocks_for_budget, cpu_kv_blocks
from asyncllm.worker.kv_tier_setup import attach_kv_tiers
from asyncllm.worker.lora import LoRAManager
from asyncllm.worker.memory import measure_graph_memory, profile_kv_budget_bytes
from asyncllm.worker.model_runner import ModelRunner
from asyncllm.worker.threads import apply_num_threads, resolve_num_threads
from asyncllm.worker.warmup import warm_up
from asyncllm.worker.worker import Worker

# The graphs' pool is measured for the largest size only; the others share it but may fragment it a little.
_GRAPH_MEMORY_MARGIN = 1.25

logger = logging.getLogger(__name__)


def build_worker(
    config: EngineConfig,
    checkpoint: Checkpoint,
    resolved: ResolvedModel,
    parallel: TPGroup | None = None,
    agree: Callable[[int], int] = lambda num_blocks: num_blocks,
) -> Worker:
    """A ready worker. `agree`: every rank's KV block count from this rank's (the smallest: a collective)."""
    setup = WorkerSetup(config, checkpoint, resolved, parallel)
    setup.apply_threads()  # before loading: dequantizing and copying weights run on these threads too
    # On CUDA the vocabulary's grammar tables (1-2 s of host work for a 150k vocabulary, holding the GIL) are
    # built while the engine loads, warms up and captures, from the start: the load and the memory profile wait
    # on files and the device, where the launch-bound warm-up would wait on the GIL. The engine serves once they
    # are in. On CPU they stay lazy: the host is the device, and most CPU engines never see a constraint.
    grammar = setup.grammar()
    tables = grammar.prepare_async() if grammar is not None and resolved.device.type == "cuda" else None
    loaded = setup.load()
    num_blocks = agree(setup.num_blocks(loaded))
    runner = setup.runner(loaded, num_blocks, grammar)
    setup.warm_up(runner, num_blocks)
    setup.capture(runner)
    if tables is not None:
        setup.wait_for_grammar_tables(tables)
    if runner.grammars.process is not None:  # ASYNCLLM_GRAMMAR_PROCESS=on: started with the runner, ready to serve
        setup.wait_for_grammar_process(runner)
    return attach_kv_tiers(Worker(runner, setup.runtime_info(loaded, runner, num_blocks)), setup)


@dataclass(frozen=True)
class LoadedModel:
    """The model on its device, its layers' attention backend, LoRA manager (or None) and draft model (or None)."""

    model: CausalLM
    backend: AttentionBackend
    loras: LoRAManager | None = None
    draft: LoadedDraft | LoadedEagle3 | None = None  # speculative_config's "draft_model" or "eagle3" head


class WorkerSetup:
    """The set-up steps, in `build_worker`'s order, over what they share (config, resolved model, shard)."""

    def __init__(
        self, config: EngineConfig, checkpoint: Checkpoint, resolved: ResolvedModel, parallel: TPGroup | None
    ) -> None:
        self.config = config = config.resolved(streaming=False)  # a no-op for an engine's config (settled)
        self.checkpoint = checkpoint
        self.resolved = resolved
        self.parallel = parallel
        # This rank's share of the heads (the whole model without tensor parallelism): the KV cache's shape.
        self.local_arch = shard_arch(resolved.arch, 1 if parallel is None else parallel.world_size)
        self.kv_spec = KVCacheSpec(
            num_layers=resolved.arch.num_layers,
            num_kv_heads=self.local_arch.num_kv_heads,
            head_dim=resolved.arch.head_dim,
            block_size=config.cache_config.block_size,
            dtype=resolved.kv_cache_dtype,
        )
        self.timings: dict[str, float] = {}  # start-up seconds per step, reported in RuntimeInfo
        self.decode_layers = 0  # decoder layers switched to one launch (ASYNCLLM_DECODE_LAYER)
        self.num_threads: int | None = None

    def apply_threads(self) -> None:
        """torch's CPU threads, in the calling thread: the one that builds the worker runs its steps."""
        world = 1 if self.parallel is None else self.parallel.world_size
        chosen = self.config.device_config.num_threads
        self.num_threads = apply_num_threads(resolve_num_threads(chosen, self.resolved.device, world))

    def load(self) -> LoadedModel:
        start = time.perf_counter()
        device, dtype = self.resolved.device, self.resolved.dtype
        tuning = self.resolved.tuning
        cascade = tuning.cascade_attention
        if self.resolved.arch.kv_window is not None:  # every layer slides: no layer would read a shared prefix
            cascade = CascadeAttention.OFF
        backend = make_attention_backend(
            self.config.device_config.attention_backend,
            device,
            dtype,
            self.local_arch.num_kv_heads,
            self.resolved.kv_cache_dtype,
            cascade,
            self.local_arch.num_heads // self.local_arch.num_kv_heads,
            tuning.decode_fold_reduce,
            tuning.decode_pdl,  # checked below with the layers' kernels (check_pdl)
        )
        check_layer_prefetch(device, tuning.decode_layer, tuning.decode_layer_prefetch)  # before the weights load
        mc = self.config.model_config
        module = load_model(
            self.checkpoint,
            self.resolved.arch,
            backend,
            device,
            dtype,
            mc.load_format,
            mc.seed,
            self.parallel,
            self.resolved.quant,
        )
        # The adapter slots are allocated with the model, before memory is profiled for the KV cache.
        loras = self._lora_manager(module)
        # The Triton backend brings the fused kernels; the torch backend keeps the pure-PyTorch forms, the reference.
        fused = backend.name == "triton"
        if fused:
            use_fused_kernels(module)
            set_decode_gemv(module, tuning.decode_gemv)  # "on" or "off"; "auto" is timed below
        if tuning.decode_pdl:
            check_pdl(device, fused)
            use_pdl(module, True)
        self.timings["load"] = time.perf_counter() - start
        if device.type == "cuda" and not self.config.device_config.enforce_eager:
            start = time.perf_counter()
            choices = tune_linear_layers(module, device, gemv=fused and tuning.decode_gemv == DecodeGemv.AUTO)
            self.timings["tune_gemm"] = time.perf_counter() - start
            logger.debug(
                "linear weights stored [in, out] for shapes %s", [s for s, c in choices.items() if c.transposed]
            )
            logger.debug("one token row through the GEMV for shapes %s", [s for s, c in choices.items() if c.gemv])
            logger.debug("the op before folded into the GEMV for %d layers", prologue_layers(module))
        if fused and tuning.decode_layer and self.parallel is None:  # after the tuning: the weights' final layout
            seqs, prefetch = self.config.scheduler_config.max_num_seqs, tuning.decode_layer_prefetch.value
            self.decode_layers = use_one_launch_layers(module, device, seqs, prefetch)
        draft = load_draft(self.config, self.checkpoint, self.resolved, module, first_rank=self._reports)
        return LoadedModel(module, backend, loras, draft)

    def _lora_manager(self, module: CausalLM) -> LoRAManager | None:
        lora = self.config.lora_config
        if not lora.enable_lora:
            return None
        rank, world = (0, 1) if self.parallel is None else (self.parallel.rank, self.parallel.world_size)
        return LoRAManager(module, self.resolved.arch, lora.max_loras, lora.max_lora_rank, rank, world)

    def num_blocks(self, loaded: LoadedModel) -> int:
        """The KV blocks: `num_kv_blocks`, else what memory allows, at most what max_num_seqs full sequences use."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        max_model_len = self.resolved.arch.max_model_len
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        max_useful = sched.max_num_seqs * -(-max_model_len // cache.block_size)
        device, extra = self.resolved.device, draft_bytes(loaded.draft)  # a draft model's cache shares the budget
        if device.type == "cpu":
            return cpu_kv_blocks(self.kv_spec, cache.cpu_kv_cache_gib, max_model_len, max_useful, extra)
        start = time.perf_counter()
        budget = profile_kv_budget_bytes(
            loaded.model,
            loaded.backend,
            self.kv_spec,
            device,
            vocab_size=self.resolved.arch.vocab_size,
            max_num_tokens=min(sched.max_num_batched_tokens, max_model_len),
            max_num_seqs=sched.max_num_seqs,
            gpu_memory_utilization=cache.gpu_memory_utilization,
        )
        if self._use_cuda_graphs(loaded.backend):
            buckets = self._buckets(loaded.backend, max_model_len)
            graph_bytes = measure_graph_memory(
                loaded.model,
                buckets,
                self.kv_spec,
                self.resolved.arch.hidden_size,
                self.resolved.dtype,
                device,
                decode_logits=self._graph_sampling(loaded.backend),
            )
            budget -= int(graph_bytes * _GRAPH_MEMORY_MARGIN)
            logger.info("CUDA graphs will hold about %.1f MiB", graph_bytes / 2**20)
        self.timings["profile"] = time.perf_counter() - start
        return blocks_for_budget(self.kv_spec, max(budget, 0), max_useful, extra)

    def runner(self, loaded: LoadedModel, num_blocks: int, grammar: GrammarBackend | None) -> ModelRunner:
        """Allocate the cache and the step's input buffers, and the runner that uses them (`grammar`: this
        process's constraint compiler, `grammar()`)."""
        start = time.perf_counter()
        cache, sched = self.config.cache_config, self.config.scheduler_config
        device, max_model_len = self.resolved.device, self.resolved.arch.max_model_len
        if num_blocks * cache.block_size < max_model_len and self._reports:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: longer requests are refused and "
                "outputs stop ('length') when a sequence fills it; raise num_kv_blocks (or GPU memory) to avoid it",
                num_blocks * cache.block_size,
                max_model_len,
            )
        kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, device)
        max_seq_len = min(max_model_len, num_blocks * cache.block_size)
        buckets = self._buckets(loaded.backend, max_seq_len)
        max_blocks_per_seq = -(-max_seq_len // cache.block_size)
        buffers = InputBuffers(
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
            max_blocks_per_seq,
            cache.block_size,
            device,
            buckets.work_room(),
        )
        arch = self.resolved.arch
        graph_sampling = self._graph_sampling(loaded.backend)
        ranks, tuning = 1 if self.parallel is None else self.parallel.world_size, self.resolved.tuning
        lazy = tuning.cuda_graph_capture is CudaGraphCapture.LAZY and ranks == 1  # TP: every rank captures at start
        model, dtype = loaded.model, self.resolved.dtype
        graphs = CudaGraphRunner(model, kv_caches, buffers, buckets, arch.hidden_size, dtype, device, loaded.loras,
                                 decode_logits=graph_sampling, lazy=lazy)  # fmt: skip
        runner = ModelRunner(
            loaded.model,
            loaded.backend,
            buffers,
            graphs,
            device,
            self.checkpoint.eos_token_ids,
            arch.vocab_size,
            grammar,
            defer_masked_draw=device.type == "cuda",
            loras=loaded.loras,
            draft=make_draft_model(loaded.draft, num_blocks, sched.max_num_seqs, max_seq_len, device),
            grammar_process=GrammarProcessMode.of(tuning.grammar_process, device, ranks),
            grammar_process_threads=self._grammar_process_threads(),
            # One rank only: every rank's matchers must give the same masks, and whether a forced run's first
            # token is drawn already (jump-forward), a draw waits on its rows' flag (FillJob) or sits out (the slow
            # lane: deferral.py) depends on when rank 0's core reads a step, or when its lane's thread is done.
            jump_forward=tuning.jump_forward and ranks == 1,
            graph_draw=graph_sampling,
            awaited_masks=ranks == 1,
            grammar_slow_fill_s=tuning.grammar_slow_fill_s if ranks == 1 else None,
        )
        if loaded.loras is not None:  # after the runner declared its fixed regions (the graphed draw's): binding
            loaded.loras.bind(buffers.staging, buffers.max_num_tokens)  # allocates the staging buffer
        logger.debug(
            "KV cache: %d blocks of %d tokens (%s, %s)", num_blocks, cache.block_size, device, self.kv_spec.dtype
        )
        self.timings["kv_cache"] = time.perf_counter() - start
        return runner

    def warm_up(self, runner: ModelRunner, num_blocks: int) -> None:
        """Compile every Triton kernel eager steps launch (CUDA only: on CPU nothing compiles)."""
        if self.resolved.device.type != "cuda":
            return
        sched = self.config.scheduler_config
        self.timings["warm_up"] = warm_up(
            runner,
            block_size=self.config.cache_config.block_size,
            num_blocks=num_blocks,
            max_model_len=self.resolved.arch.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
        )
        if runner.loras is not None:
            with torch.inference_mode():
                runner.loras.compile_kernels()

    def wait_for_grammar_tables(self, tables: Future[object]) -> None:
        t0 = time.perf_counter()
        if tables.exception() is not None:  # left for the first constrained request to raise, naming its field
            logger.warning("building the grammar tables failed: %s", tables.exception())
        self.timings["grammar_tables_wait"] = time.perf_counter() - t0

    def wait_for_grammar_process(self, runner: ModelRunner) -> None:
        t0 = time.perf_counter()
        if not runner.grammars.wait_for_process():  # the step thread's matchers serve instead
            logger.warning("ASYNCLLM_GRAMMAR_PROCESS=on, but the grammar process did not start")
        self.timings["grammar_process_wait"] = time.perf_counter() - t0

    def capture(self, runner: ModelRunner) -> None:
        if not self._use_cuda_graphs(runner.backend):
            return
        graphs = runner.graphs
        self.timings["capture"] = runner.capture_graphs()
        phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in graphs.capture_seconds.items())
        decode, mixed = graphs.sizes("decode"), graphs.sizes("mixed")
        later = f", {graphs.pending} more when idle or at the first step needing each" if graphs.lazy else ""
        logger.info(
            "captured %d CUDA graphs in %.2f s (%s%s): decode batch sizes %s, token counts %s, %d draw graphs",
            *(graphs.captured, self.timings["capture"], phases, later, decode, mixed, len(graphs.tail_sizes())),
        )

    def runtime_info(self, loaded: LoadedModel, runner: ModelRunner, num_blocks: int) -> RuntimeInfo:
        """What the engine core needs to know, once set-up is done."""
        arch = self.resolved.arch
        return RuntimeInfo(
            vocab_size=arch.vocab_size,
            max_model_len=arch.max_model_len,
            num_kv_blocks=num_blocks,
            block_size=self.config.cache_config.block_size,
            eos_token_ids=self.checkpoint.eos_token_ids,
            device=str(self.resolved.device),
            dtype=str(self.resolved.dtype).removeprefix("torch."),
            attention_backend=loaded.backend.name,
            cuda_graph_sizes=tuple(runner.graphs.sizes("decode")),
            cuda_graph_token_sizes=tuple(runner.graphs.sizes("mixed")),
            cuda_graphs_pending=runner.graphs.pending,
            startup_seconds=tuple(self.timings.items()),
            architecture=arch.architecture,
            kv_cache_bytes=num_blocks * (self.kv_spec.bytes_per_block + draft_bytes(loaded.draft)),
            num_threads=self.num_threads,
            max_loras=loaded.loras.num_slots if loaded.loras is not None else 0,
            gemv_layers=gemv_layers(loaded.model),
            prologue_layers=prologue_layers(loaded.model),
            decode_layers=self.decode_layers,
            kv_window=arch.kv_window,
        )

    @property
    def _reports(self) -> bool:
        """This worker reports the engine's facts (rank 0, or the only rank): warnings about the engine as a
        whole are logged once, not once per rank."""
        return self.parallel is None or self.parallel.rank == 0

    def grammar(self) -> GrammarBackend | None:
        """This process's compiler of output constraints, over the checkpoint's tokenizer and the model's
        embedding rows, ending with its EOS ids (built lazily: free until the first constrained request)."""
        checkpoint, eos, vocab_size = self.checkpoint, self.checkpoint.eos_token_ids, self.resolved.arch.vocab_size
        if not eos:
            return None
        if checkpoint.tokenizer is not None:
            return GrammarBackend(checkpoint.tokenizer, vocab_size, eos)
        if checkpoint.load_tokenizer is not None:  # a worker rank's: loaded by the first constraint
            return GrammarBackend.deferred(checkpoint.load_tokenizer, vocab_size, eos)
        return None

    def _grammar_process_threads(self) -> int:
        """The grammar process's filling threads: ASYNCLLM_GRAMMAR_PROCESS_THREADS where given, else the cores
        this process may use, less two (the step thread and the device's driver), shared among the ranks (each
        rank has its own process), at most `MAX_FILL_THREADS` (more fill no faster)."""
        chosen = self.resolved.tuning.grammar_process_threads
        if chosen is not None:
            return chosen
        world = 1 if self.parallel is None else self.parallel.world_size
        return max(1, min(MAX_FILL_THREADS, (len(os.sched_getaffinity(0)) - 2) // world))

    def _use_cuda_graphs(self, backend: AttentionBackend) -> bool:
        """Graphs on CUDA unless enforce_eager, with a backend that can be captured (Triton, not the torch
        reference, whose decode path plans on the host)."""
        enforce_eager = self.config.device_config.enforce_eager
        return self.resolved.device.type == "cuda" and not enforce_eager and backend.supports_cuda_graphs

    def _graph_sampling(self, backend: AttentionBackend) -> bool:
        """Decode graphs run the LM head, and plain steps' draw in a graph of its own (ASYNCLLM_CUDA_GRAPH_SAMPLING,
        where CUDA graphs are captured)."""
        return self._use_cuda_graphs(backend) and self.resolved.tuning.cuda_graph_sampling

    def _buckets(self, backend: AttentionBackend, max_seq_len: int) -> Buckets:
        """The buckets steps pad to (also eagerly, with a backend that could be captured, so that
        `enforce_eager` computes the same numbers as graphs)."""
        sched = self.config.scheduler_config
        graph_tokens = self.resolved.tuning.cuda_graph_max_tokens
        return Buckets.for_engine(backend, sched.max_num_seqs, sched.max_num_batched_tokens, graph_tokens, max_seq_len)
