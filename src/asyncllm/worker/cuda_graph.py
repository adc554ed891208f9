"""CUDA graphs: one per captured decode batch size, and one per captured token count for every other step
(prompt chunks beside decodes), replayed instead of ~300 launches.

Owns capture, padding and replay. Each graph reads the step's inputs from the persistent `InputBuffers`
(the same device tensors every step fills) and writes the final hidden states into one shared static
buffer; all graphs share one memory pool, captured largest first so smaller ones reuse its blocks. The
attention backend plans each captured shape statically (`plan_graph_decode`, `plan_graph_mixed`); steps
larger than the largest token count stay eager. The `ModelRunner` decides which path a step takes and pads
it. Knows nothing of requests or sampling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from asyncllm.attention.backend import AttentionBackend
from asyncllm.attention.layer import KVCache
from asyncllm.step import ScheduledSeq, SchedulerOutput
from asyncllm.worker.input_batch import InputBuffers
from asyncllm.worker.kv_cache import KVCacheSpec, allocate_kv_cache


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_num_seqs` (which is always included): a step pads to the next."""
    sizes = {n for n in (1, 2, 4, 8) if n <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def token_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts of the mixed-step graphs: every 16 up to 128, then four per doubling (a step pads by at
    most a quarter of its tokens), and `max_tokens` itself; none below 16 tokens."""
    if max_tokens < 16:
        return []
    sizes = set(range(16, min(max_tokens, 128) + 1, 16))
    base = 128
    while base < max_tokens:
        sizes.update(s for s in (base * 5 // 4, base * 3 // 2, base * 7 // 4, base * 2) if s <= max_tokens)
        base *= 2
    sizes.add(max_tokens)
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
        self.sizes: list[int] = []  # decode batch sizes captured, ascending
        self.token_sizes: list[int] = []  # mixed-step token counts captured, ascending
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._pool: tuple[int, int] | None = None
        self._hidden_shape = (hidden_size, dtype)
        self._hidden = torch.empty(0, hidden_size, dtype=dtype, device=device)  # [largest captured size, hidden]

    @torch.inference_mode()
    def capture(self, sizes: Sequence[int], token_sizes: Sequence[int] = ()) -> float:
        """Capture a graph per decode size and per mixed-step token count (largest first, one shared pool);
        returns the seconds it took."""
        if self._graphs:
            raise RuntimeError("CudaGraphRunner.capture runs once: the graphs hold its output buffer's address")
        start = time.perf_counter()
        shapes = [("decode", n) for n in sizes] + [("mixed", n) for n in token_sizes]
        hidden_size, dtype = self._hidden_shape
        rows = max((n for _, n in shapes), default=0)  # the largest graph's rows, not the step budget's
        self._hidden = torch.empty(rows, hidden_size, dtype=dtype, device=self.device)
        for kind, size in sorted(shapes, key=lambda shape: -shape[1]):
            if kind == "decode":
                x = self.buffers.prepare(_dummy_decode(size), pad_to=size, flush=False)
                self.backend.plan_graph_decode(x.meta, size, self.max_seq_len)
            else:
                x = self.buffers.prepare(_dummy_mixed(self.buffers.block_size), pad_tokens_to=size, flush=False)
                self.backend.plan_graph_mixed(x.meta, size, self.buffers.max_num_seqs, self.max_seq_len)
            self.buffers.flush()

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
            self._graphs[kind, size] = graph
        self.sizes = sorted(n for kind, n in self._graphs if kind == "decode")
        self.token_sizes = sorted(n for kind, n in self._graphs if kind == "mixed")
        for graph in self._graphs.values():
            graph.replay()  # a graph's first launch uploads it: the first request must not pay that
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def has(self, size: int) -> bool:
        return ("decode", size) in self._graphs

    def has_mixed(self, num_tokens: int) -> bool:
        return ("mixed", num_tokens) in self._graphs

    def replay(self, size: int, num_seqs: int) -> torch.Tensor:
        """Run the decode graph of `size` over the inputs already in the buffers; [num_seqs, hidden]."""
        self._graphs["decode", size].replay()
        return self._hidden[:num_seqs]

    def replay_mixed(self, num_tokens: int) -> torch.Tensor:
        """Run the mixed-step graph of `num_tokens` (inputs and attention plan already written); [num_tokens,
        hidden], padding rows included."""
        self._graphs["mixed", num_tokens].replay()
        return self._hidden[:num_tokens]

    def release(self) -> None:
        self._graphs.clear()
        self.sizes = []
        self.token_sizes = []
        self._pool = None


def _dummy_decode(size: int) -> SchedulerOutput:
    """`size` one-token sequences at position 0 in block 0; capture overwrites its KV slot, never read."""
    return SchedulerOutput(seqs=[ScheduledSeq(f"capture-{i}", [0], 0, [0], True) for i in range(size)])


def _dummy_mixed(block_size: int) -> SchedulerOutput:
    """A two-token prompt in block 0 (capture overwrites it, never read), padded by the caller. Only launch
    shapes are captured: both attention kernels launch whatever the step holds, over the work list the
    backend rewrites per step."""
    return SchedulerOutput(seqs=[ScheduledSeq("capture-0", [0, 0], 0, [0] * -(-2 // block_size), True)])


@torch.inference_mode()
def measure_graph_memory(
    model: nn.Module,
    backend: AttentionBackend,
    kv_spec: KVCacheSpec,
    max_num_seqs: int,
    max_num_tokens: int,
    max_graph_tokens: int,
    max_seq_len: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Bytes the graphs will hold, measured by capturing the largest decode and mixed-step graphs over a
    throwaway one-block cache (the smaller graphs reuse their pool). Called before the KV cache is sized,
    so the cache leaves room."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    scratch = allocate_kv_cache(kv_spec, 1, device)
    buffers = InputBuffers(max_num_tokens, max_num_seqs, 2, kv_spec.block_size, device)  # 2: the mixed dummy
    runner = CudaGraphRunner(model, backend, scratch, buffers, max_seq_len, hidden_size, dtype, device)
    runner.capture([min(max_num_seqs, max_num_tokens)], token_capture_sizes(max_graph_tokens)[-1:])
    used = torch.cuda.memory_reserved(device) - before
    runner.release()
    del runner, buffers, scratch
    torch.cuda.empty_cache()
    return max(used, 0)
