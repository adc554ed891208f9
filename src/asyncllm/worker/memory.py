"""How much device memory the KV cache may take: measured by running the largest step the engine can
schedule (with a throwaway cache) and keeping what `gpu_memory_utilization` leaves after that peak, less
what the CUDA graphs will hold (measured by capturing the largest ones over a throwaway cache).

Knows the model only as something that runs one forward pass; nothing here outlives the measurement.
"""

from __future__ import annotations

import torch

from asyncllm.attention.backend import AttentionBackend, PlanBounds
from asyncllm.models.base import CausalLM
from asyncllm.step import ScheduledSeq, SchedulerOutput
from asyncllm.worker.buckets import Buckets
from asyncllm.worker.cuda_graph import CudaGraphRunner
from asyncllm.worker.input_batch import InputBuffers, WorkRoom
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache


@torch.inference_mode()
def profile_kv_budget_bytes(
    model: CausalLM,
    backend: AttentionBackend,
    spec: KVCacheSpec,
    device: torch.device,
    *,
    vocab_size: int,
    max_num_tokens: int,
    max_num_seqs: int,
    gpu_memory_utilization: float,
) -> int:
    """Bytes left for the KV cache after the peak of a `max_num_tokens`-token prefill (and its sampler)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    n = max_num_tokens
    blocks = -(-n // spec.block_size)
    scratch = allocate_kv_cache(spec, blocks, device)
    ids = torch.randint(0, vocab_size, (n,)).tolist()
    probe = SchedulerOutput(seqs=[ScheduledSeq("profile", ids, 0, list(range(blocks)), True)])
    step_work = backend.work_size(PlanBounds(n, 1, n))
    buffers = InputBuffers(n, 1, blocks, spec.block_size, device, WorkRoom(step=step_work, dtype=backend.work_dtype))
    x = buffers.prepare(probe, flush=False)
    buffers.stage_plan(x.meta, backend.plan(x.meta), static=False)
    buffers.flush()
    hidden = model(x.input_ids, x.positions, scratch, x.meta)
    # The sampler's peak: float32 logits (and a softmax-sized temporary) for a full batch of sequences.
    rows = hidden[: min(max_num_seqs, n)]
    torch.softmax(model.compute_logits(rows).float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del scratch, hidden, x, buffers
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    free_now, _ = torch.cuda.mem_get_info(device)
    others = total - free_now - torch.cuda.memory_reserved(device)  # other processes on the GPU
    budget = int(total * gpu_memory_utilization) - peak - max(others, 0)
    return max(budget, 0)


@torch.inference_mode()
def measure_graph_memory(
    model: CausalLM,
    buckets: Buckets,
    kv_spec: KVCacheSpec,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    decode_logits: bool = False,
) -> int:
    """Bytes the graphs of `buckets` will hold, measured by capturing the largest decode and mixed-step
    graphs over a throwaway one-block cache (the smaller graphs reuse their pool); `decode_logits`: decode
    graphs run the LM head too (its static logits and its pool share included; the draw graphs' own few
    bytes per row are not). Called before the KV cache is sized, so the cache leaves room."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    scratch = allocate_kv_cache(kv_spec, 1, device)
    largest = buckets.largest()
    # 2 blocks per sequence: the mixed graph's dummy prompt
    buffers = InputBuffers(
        largest.max_num_tokens, largest.max_num_seqs, 2, kv_spec.block_size, device, largest.work_room()
    )
    graphs = CudaGraphRunner(model, scratch, buffers, largest, hidden_size, dtype, device, decode_logits=decode_logits)
    graphs.capture()
    used = torch.cuda.memory_reserved(device) - before
    graphs.release()
    del graphs, buffers, scratch
    torch.cuda.empty_cache()
    return max(used, 0)
