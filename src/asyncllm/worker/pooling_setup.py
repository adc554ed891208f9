"""`build_pooling_worker`: an embed or score engine's `Worker`, built as `build_worker` builds a generation
one (the same load: attention backend, weights, fused kernels, GEMM layouts) but with a `PoolingRunner` and
the KV cache its forward needs, which is little (`pooling_forward.py`): a decoder's cache is one layer deep
and holds two steps of the step budget (the step in flight and the one planned beside it); an encoder has
none. The scheduler still counts blocks (its one rule for fitting a step), so an encoder engine reports the
same block count with no memory behind it. No CUDA graphs: a pooling step is prompt work, large, eager.

Knows nothing of requests or scheduling.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import torch

from asyncllm.attention.backend import PlanBounds
from asyncllm.attention.registry import resolve_backend_name
from asyncllm.config import EngineConfig
from asyncllm.config_values import AttentionBackendName
from asyncllm.layers.fusion import use_fused_kernels
from asyncllm.model_loader.base import Checkpoint
from asyncllm.model_loader.encoder import load_encoder
from asyncllm.models.base import CausalLM, EncoderModel
from asyncllm.pooling import PoolerSpec, PoolingParams, pooling_step_budget
from asyncllm.sampling_params import SamplingParams
from asyncllm.step import NewRequestData, RuntimeInfo, ScheduledSeq, SchedulerOutput
from asyncllm.worker.device import ResolvedModel
from asyncllm.worker.gemm_layout import tune_linear_layers
from asyncllm.worker.input_batch import InputBuffers, WorkRoom
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache
from asyncllm.worker.pooling_forward import EncoderForward, PagedForward
from asyncllm.worker.pooling_runner import PoolingForward, PoolingRunner
from asyncllm.worker.setup import LoadedModel, WorkerSetup
from asyncllm.worker.worker import Worker

_STEPS_IN_FLIGHT = 2  # the step running and the one planned beside it (async scheduling): their blocks at once


def build_pooling_worker(
    config: EngineConfig, checkpoint: Checkpoint, resolved: ResolvedModel, spec: PoolerSpec
) -> Worker:
    """A ready worker for an embed or score engine (one rank: no tensor parallelism)."""
    if not spec.encoder and not spec.scores:
        # An embedder never reads the LM head: built tied (no head), whatever its checkpoint has.
        resolved = dataclasses.replace(resolved, arch=dataclasses.replace(resolved.arch, tie_word_embeddings=True))
    setup = WorkerSetup(config, _model_named(checkpoint, spec), resolved, None)
    setup.apply_threads()
    cache, sched = config.cache_config, config.scheduler_config
    arch, device, block_size = resolved.arch, resolved.device, cache.block_size
    budget = pooling_step_budget(sched.max_num_batched_tokens, arch.max_model_len)
    num_blocks = cache.num_kv_blocks
    if num_blocks is None:
        num_blocks = _STEPS_IN_FLIGHT * (-(-budget // block_size) + sched.max_num_seqs)
    kv_bytes = 0
    forward: PoolingForward
    if spec.encoder:
        encoder, backend_name = _load_encoder(setup)
        forward = EncoderForward(encoder, device)
    else:
        loaded = setup.load()
        backend_name = loaded.backend.name
        forward, kv_bytes = _paged(setup, loaded, budget, num_blocks)
    start = time.perf_counter()
    runner = PoolingRunner(forward, spec, device)
    setup.timings["kv_cache"] = time.perf_counter() - start
    if device.type == "cuda":  # compile the step's Triton kernels before the first request
        start = time.perf_counter()
        _warm_up(runner, block_size, num_blocks, arch.max_model_len)
        setup.timings["warm_up"] = time.perf_counter() - start
    runtime = RuntimeInfo(
        vocab_size=arch.vocab_size,
        max_model_len=arch.max_model_len,
        num_kv_blocks=num_blocks,
        block_size=block_size,
        eos_token_ids=checkpoint.eos_token_ids,
        device=str(device),
        dtype=str(resolved.dtype).removeprefix("torch."),
        attention_backend=backend_name,
        startup_seconds=tuple(setup.timings.items()),
        architecture=arch.architecture,
        kv_cache_bytes=kv_bytes,
        num_threads=setup.num_threads,
        task=spec.task,
        pooler=spec,
    )
    return Worker(runner, runtime)


def _load_encoder(setup: WorkerSetup) -> tuple[EncoderModel, str]:
    """An encoder on its device, its attention on the Triton kernel where the engine takes the Triton backend
    (the torch twin otherwise, as decoders' fused layers), linear layouts tuned as a decoder's on CUDA."""
    start = time.perf_counter()
    mc, device = setup.config.model_config, setup.resolved.device
    model = load_encoder(setup.checkpoint, setup.resolved.arch, device, setup.resolved.dtype, mc.load_format, mc.seed)
    backend = resolve_backend_name(setup.config.device_config.attention_backend, device)
    if backend is AttentionBackendName.TRITON:
        use_fused_kernels(model)
    if device.type == "cuda" and not setup.config.device_config.enforce_eager:
        tune_linear_layers(model, device, gemv=False)
    setup.timings["load"] = time.perf_counter() - start
    return model, backend.value


def _paged(setup: WorkerSetup, loaded: LoadedModel, budget: int, num_blocks: int) -> tuple[PagedForward, int]:
    """A decoder's forward with its one-layer cache, and the cache's bytes."""
    assert isinstance(loaded.model, CausalLM)
    sched, spec = setup.config.scheduler_config, setup.kv_spec
    layer = KVCacheSpec(1, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.dtype)
    (kv,) = allocate_kv_cache(layer, num_blocks, setup.resolved.device)
    max_seq_len = min(setup.resolved.arch.max_model_len, num_blocks * spec.block_size)
    backend = loaded.backend
    work = WorkRoom(0, backend.work_size(PlanBounds(budget, sched.max_num_seqs, max_seq_len)), backend.work_dtype)
    max_blocks = -(-max_seq_len // spec.block_size)
    buffers = InputBuffers(budget, sched.max_num_seqs, max_blocks, spec.block_size, setup.resolved.device, work)
    return PagedForward(loaded.model, backend, buffers, kv), num_blocks * layer.bytes_per_block


def _model_named(checkpoint: Checkpoint, spec: PoolerSpec) -> Checkpoint:
    """A decoder embedder saved as its base model (Qwen3-Embedding: `layers.0...`, no `model.` prefix and no
    head, though config.json names Qwen3ForCausalLM) loads under the causal LM's names."""
    if spec.encoder:
        return checkpoint
    weights = checkpoint.iter_weights

    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights():
            yield (name if name.startswith(("model.", "lm_head.")) else f"model.{name}"), tensor

    return dataclasses.replace(checkpoint, iter_weights=named, iter_weight_shards=None)


def _warm_up(runner: PoolingRunner, block_size: int, num_blocks: int, max_model_len: int) -> None:
    """One step of two short inputs (nothing else runs yet: any blocks are free)."""
    lens = [n for n in (min(16, max_model_len), min(5, max_model_len)) if n * 2 <= num_blocks * block_size]
    seqs, new, first = [], [], 0
    for i, n in enumerate(lens):
        blocks = list(range(first, first + -(-n // block_size)))
        first += len(blocks)
        seqs.append(ScheduledSeq(f"warm-up-{i}", [0] * n, 0, blocks, True))
        new.append(NewRequestData(f"warm-up-{i}", [0] * n, SamplingParams(), 0, pooling=PoolingParams()))
    if seqs:
        runner.submit(SchedulerOutput(seqs, new)).result()
