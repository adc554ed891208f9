"""CUDA graphs for decode-only steps: one graph per captured batch size, replayed instead of ~300 launches.

Owns capture, padding and replay. Each graph reads the step's inputs from the persistent `InputBuffers`
(the same device tensors every step fills) and writes the final hidden states into one shared static
buffer; all graphs share one memory pool, captured largest first so smaller ones reuse its blocks. The
attention backend plans each captured size statically (`plan_graph_decode`). Mixed prefill/decode steps
stay eager; the `ModelRunner` decides which path a step takes and pads it. Knows nothing of requests or
sampling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend
from asyncllm.attention.layer import KVCache
from asyncllm.executor.interface import ScheduledSeq, SchedulerOutput
from asyncllm.worker.input_batch import InputBuffers
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_num_seqs` (which is always included): a step pads to the next."""
    sizes = {n for n in (1, 2, 4, 8) if n <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def is_decode_only(scheduled: SchedulerOutput) -> bool:
    return all(s.num_tokens == 1 and s.sample for s in scheduled.seqs)


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        buffers: InputBuffers,
        max_seq_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name!r} attention backend cannot be captured in CUDA graphs")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.max_seq_len = max_seq_len
        self.device = device
        self.sizes: list[int] = []  # captured, ascending
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool: tuple[int, int] | None = None
        self._hidden = torch.empty(buffers.max_num_seqs, hidden_size, dtype=dtype, device=device)  # [B, hidden]

    @torch.inference_mode()
    def capture(self, sizes: Sequence[int]) -> float:
        """Capture one graph per size (largest first, one shared pool); returns the seconds it took."""
        start = time.perf_counter()
        for size in sorted(sizes, reverse=True):
            x = self.buffers.prepare(_dummy_decode(size), pad_to=size)
            self.backend.plan_graph_decode(x.meta, size, self.max_seq_len)

            def forward(x=x, size=size) -> None:  # type: ignore[no-untyped-def]
                hidden = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)  # [size, hidden]
                self._hidden[:size].copy_(hidden)

            forward()  # compiles every kernel and settles the allocator before capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call (NCCL's watchdog querying an earlier collective's
            # event, under tensor parallelism) must not invalidate this capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                forward()
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[size] = graph
        self.sizes = sorted(self._graphs)
        for graph in self._graphs.values():
            graph.replay()  # a graph's first launch uploads it: the first request must not pay that
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def has(self, size: int) -> bool:
        return size in self._graphs

    def replay(self, size: int, num_seqs: int) -> torch.Tensor:
        """Run the graph of `size` over the inputs already in the buffers; [num_seqs, hidden] final hidden."""
        self._graphs[size].replay()
        return self._hidden[:num_seqs]

    def release(self) -> None:
        self._graphs.clear()
        self.sizes = []
        self._pool = None


def _dummy_decode(size: int) -> SchedulerOutput:
    """`size` one-token sequences at position 0 in block 0; capture overwrites its KV slot, never read."""
    return SchedulerOutput(seqs=[ScheduledSeq(f"capture-{i}", [0], 0, [0], True) for i in range(size)])


@torch.inference_mode()
def measure_graph_memory(
    model: nn.Module,
    backend: AttentionBackend,
    kv_spec: KVCacheSpec,
    max_num_seqs: int,
    max_seq_len: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Bytes the graphs will hold, measured by capturing the largest one over a throwaway one-block cache
    (the smaller graphs reuse its pool). Called before the KV cache is sized, so the cache leaves room."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    scratch = allocate_kv_cache(kv_spec, 1, device)
    buffers = InputBuffers(max_num_seqs, max_num_seqs, 1, kv_spec.block_size, device)
    runner = CudaGraphRunner(model, backend, scratch, buffers, max_seq_len, hidden_size, dtype, device)
    runner.capture([max_num_seqs])
    used = torch.cuda.memory_reserved(device) - before
    runner.release()
    del runner, buffers, scratch
    torch.cuda.empty_cache()
    return max(used, 0)
