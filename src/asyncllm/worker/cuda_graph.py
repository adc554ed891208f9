"""`CudaGraphRunner`: a step's forward pass at its `StepShape`, replaying its bucket's CUDA graph when one was
captured (one launch for the whole forward pass), running the model eagerly otherwise.

Owns capture and replay. Each graph reads the step's inputs from the persistent `InputBuffers` (the same
device tensors every step fills, the attention work list included) and writes the final hidden states into
one shared static buffer; all graphs share one memory pool, captured largest first so smaller ones reuse its
blocks. With LoRA adapters each bucket has a second graph with the adapter layers active, replayed by steps
with adapter rows (the others replay the plain one: requests without adapters launch nothing of LoRA); each
attention graph variant likewise (`AttentionBackend.graph_variants`: cascade decode's, replayed by decode
steps whose sequences share a prefix). Which bucket a step takes, and how it is padded and planned:
`Buckets`.

With `decode_logits` every decode graph also runs the LM head into one static logits buffer (a decode step
samples every row of its bucket), and a `tail` given to `capture` (a plain draw: `GraphDraw.launch`) is
captured per decode bucket as a small graph of its own over those logits, replayed on demand after the
bucket's forward graph (`run_tail`): one graph for any LoRA or attention variant of the forward pass, so
start-up adds one small capture per decode size. Knows nothing of requests or sampling.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from asyncllm.attention.layer import KVCache
from asyncllm.models.base import CausalLM
from asyncllm.step import ScheduledSeq, SchedulerOutput
from asyncllm.worker.buckets import Buckets, GraphKey, StepShape
from asyncllm.worker.input_batch import InputBuffers, ModelInputs
from asyncllm.worker.lora import LoRAManager
from asyncllm.worker.step_staging import PrefixViews

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # what CUDAGraph.pool() returns and torch.cuda.graph takes

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        buffers: InputBuffers,
        buckets: Buckets,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        loras: LoRAManager | None = None,
        decode_logits: bool = False,
        lazy: bool = False,
    ) -> None:
        self.model = model
        self.decode_logits = decode_logits
        self.lazy = lazy
        self.loras = loras
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.buckets = buckets
        self.device = device
        # (bucket, LoRA active, the attention plan's graph variant) -> graph
        self._graphs: dict[tuple[GraphKey, bool, int], torch.cuda.CUDAGraph] = {}
        self._pool: _POOL_HANDLE | None = None
        self._stream: torch.cuda.Stream | None = None  # where captures record (made at the first)
        self._hidden_shape = (hidden_size, dtype)
        self._hidden = PrefixViews(torch.empty(0, hidden_size, dtype=dtype, device=device))  # [rows, hidden]
        self._logits: PrefixViews | None = None  # [rows, vocab]: decode graphs' LM head output (decode_logits)
        self._logits_rows = 0  # the static logits' rows: the largest decode bucket's
        self._planned: set[tuple[GraphKey, bool, int]] = set()  # every graph `capture` planned, captured or not
        self._tails: dict[int, torch.cuda.CUDAGraph] = {}  # decode size -> its tail's graph
        # Where capture's seconds went (the start-up log line): staging each bucket's dummy inputs and plan,
        # the eager run before each capture, the capture itself (recording and instantiation), the first replays.
        self.capture_seconds: dict[str, float] = {"stage": 0.0, "eager": 0.0, "record": 0.0, "upload": 0.0}

    def sizes(self, kind: str) -> list[int]:
        """The sizes of one kind ("decode": batch sizes, "mixed": token counts) whose steps replay graphs,
        ascending: captured, or (`lazy`) captured by the first step that needs one."""
        return sorted(n for (k, n), lora, variant in self._planned if k == kind and not lora and not variant)

    @property
    def captured(self) -> int:
        """How many forward-pass graphs are captured (every LoRA and attention variant counted)."""
        return len(self._graphs)

    @property
    def pending(self) -> int:
        """How many planned graphs no step has captured yet (`lazy`)."""
        return len(self._planned) - len(self._graphs)

    def tail_sizes(self) -> list[int]:
        """The decode sizes captured with a tail graph, ascending."""
        return sorted(self._tails)

    def run(self, shape: StepShape, x: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's final hidden states, [x.num_tokens, hidden] (padding rows included), and, where a decode
        graph ran the LM head, its logits ([x.num_tokens, vocab], static: read before the next step runs);
        its inputs, and its attention plan, already sent."""
        lora = self.loras is not None and self.loras.batch.active
        variant = 0 if x.meta.plan is None else x.meta.plan.graph_variant
        key = shape.graph
        graph = None if key is None else self._graphs.get((key, lora, variant))
        if key is None or (graph is None and not (self.lazy and (key, lora, variant) in self._planned)):
            hidden: torch.Tensor = self.model(x.input_ids, x.positions, self.kv_caches, x.meta)
            return hidden, None
        if graph is None:  # lazy: this step runs its bucket's forward pass eagerly, then records it
            assert x.num_tokens == key[1], "a bucketed step is padded to its bucket"
            with torch.inference_mode():
                self._capture_one(key, lora, variant, x, mid_serving=True)
        else:
            graph.replay()
        logits = self._logits(x.num_tokens) if self._logits is not None and key[0] == "decode" else None
        return self._hidden(x.num_tokens), logits

    def has_tail(self, shape: StepShape) -> bool:
        """Whether the step's bucket has a tail graph (a decode bucket, captured with one): `run` then replays
        the forward graph with the LM head, and `run_tail` the tail over its logits."""
        key = shape.graph
        return key is not None and key[0] == "decode" and key[1] in self._tails

    def run_tail(self, shape: StepShape) -> None:
        """Replay the tail of the step's decode bucket (after `run`)."""
        assert shape.graph is not None
        self._tails[shape.graph[1]].replay()

    @torch.inference_mode()
    def capture(self, tail: Callable[[torch.Tensor], None] | None = None) -> float:
        """Capture a graph per bucket (largest first, one shared pool), and with `decode_logits` a graph of
        `tail` (over the bucket's logits, [size, vocab]) per decode bucket; returns the seconds it took.
        `lazy`: only the largest bucket of each kind now (they set the pool's size, which the smaller graphs
        reuse, and the static buffers), and every draw graph; each other bucket's graph is captured by the
        first step that needs it (`run`), whose own forward pass is the eager run before the capture."""
        if self._planned:
            raise RuntimeError("CudaGraphRunner.capture runs once: the graphs hold its output buffer's address")
        start = time.perf_counter()
        buckets = self.buckets
        keys = sorted(buckets.graph_keys, key=lambda key: -key[1])
        hidden_size, dtype = self._hidden_shape
        rows = max((n for _, n in keys), default=0)  # the largest graph's rows, not the step budget's
        self._hidden = PrefixViews(torch.empty(rows, hidden_size, dtype=dtype, device=self.device))
        self._logits_rows = max((n for k, n in keys if k == "decode"), default=0)
        variants = (False, True) if self.loras is not None else (False,)
        backend = buckets.backend
        captures = [
            (key, lora, attn)
            for key in keys
            for lora in variants
            for attn in backend.graph_variants(buckets.bounds(key))  # cascade decode: a graph of its own
        ]
        self._planned.update(captures)
        largest = {kind: max((n for k, n in keys if k == kind), default=0) for kind in ("decode", "mixed")}
        for key, lora, attn in captures:
            if not self.lazy or key[1] == largest[key[0]]:
                self._capture_staged(key, lora, attn)
        if self.loras is not None:
            self.loras.stage_idle(0, active=False)
        if self._logits is not None and tail is not None:
            self._capture_tails(tail, sorted({n for k, n in keys if k == "decode"}, reverse=True))
        t0 = time.perf_counter()
        for graph in self._tails.values():
            graph.replay()  # over the logits the forward graphs left
        torch.cuda.synchronize(self.device)
        # The eager runs' activations, cached since no capture emptied the cache: returned as torch.cuda.graph
        # would have (measure_graph_memory counts what the graphs hold, nothing else).
        torch.cuda.empty_cache()
        self.capture_seconds["upload"] += time.perf_counter() - t0
        return time.perf_counter() - start

    @torch.inference_mode()
    def capture_next(self) -> int:
        """`lazy`, while the engine idles (no request in flight): capture the smallest graph still pending
        (small batches and short prompts come first to a fresh engine; the largest, captured at start-up, sized
        the pool), over dummy inputs that write no KV (the cache holds live prefixes now); returns how many are
        left. Each call costs one eager run and one recording (~15-40 ms on an H100): a request that arrives
        waits for at most one."""
        left = sorted(self._planned.difference(self._graphs), key=lambda c: (c[0][1], c[0][0], c[1], c[2]))
        if not left:
            return 0
        key, lora, attn = left[0]
        try:
            self._capture_staged(key, lora, attn, serving=True)
        except RuntimeError as exc:  # its eager run out of memory, most likely: an idle engine must not die of it
            self._leave_eager(key, lora, attn, exc)
        if self.loras is not None:
            self.loras.stage_idle(0, active=False)
        return self.pending

    def _capture_staged(self, key: GraphKey, lora: bool, attn: int, serving: bool = False) -> None:
        """Stage the bucket's dummy inputs and attention plan, capture its graph and launch it once (a graph's
        first launch uploads it: the first request must not pay that), over its own inputs. `serving` (an
        idle capture): the dummy rows write no KV (slot -1; their attention reads block 0, whatever it holds,
        into outputs never read), and a failed capture leaves its bucket eager (`_capture_one`)."""
        t0 = time.perf_counter()
        buffers, kind, size = self.buffers, *key
        if kind == "decode":
            x = buffers.prepare(_dummy_decode(size), pad_to=size, flush=False)
        else:
            x = buffers.prepare(_dummy_mixed(buffers.block_size), pad_tokens_to=size, flush=False)
        if serving:
            buffers.slot_mapping.put([-1] * x.num_tokens)
        buffers.stage_plan(x.meta, self.buckets.backend.plan(x.meta, self.buckets.bounds(key), attn), static=True)
        if self.loras is not None:  # adapter layers active or not, with no adapter row: compiled, no work
            self.loras.stage_idle(x.num_tokens, active=lora)
        buffers.flush()
        self.capture_seconds["stage"] += time.perf_counter() - t0
        self._capture_one(key, lora, attn, x, mid_serving=serving)
        t0 = time.perf_counter()
        graph = self._graphs.get((key, lora, attn))
        if graph is not None:  # None: a failed capture mid-serving (its bucket stays eager)
            graph.replay()
        self.capture_seconds["upload"] += time.perf_counter() - t0

    def _capture_one(self, key: GraphKey, lora: bool, attn: int, x: ModelInputs, mid_serving: bool = False) -> None:
        """Run the bucket's forward pass over the staged inputs `x` eagerly (compiling every kernel and settling
        the allocator), then record it as the graph of (key, lora, attn). `mid_serving` (a lazy capture, the
        eager run a step's own): the device is not waited for (recording runs nothing, and needs nothing
        finished), and a capture that fails leaves its bucket eager with a warning, the step's outputs made."""
        kind, size = key
        head = self.decode_logits and kind == "decode"
        hidden = self._hidden(size)

        def forward() -> None:
            hidden.copy_(self.model(x.input_ids, x.positions, self.kv_caches, x.meta))  # [size, hidden]
            if head:
                # The eager path's LM head call over the same rows: the same numbers, then kept static.
                step_logits = self.model.compute_logits(hidden)  # [size, vocab]
                if self._logits is None:  # eagerly, before the first capture: outside the graphs' pool
                    rows = step_logits.new_empty(self._logits_rows, step_logits.shape[1])
                    self._logits = PrefixViews(rows)
                self._logits(size).copy_(step_logits)

        t1 = time.perf_counter()
        forward()
        if not mid_serving:
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        try:
            self._graphs[key, lora, attn] = self._record(forward)
        except RuntimeError as exc:  # out of memory for the pool, most likely: the bucket stays eager
            if not mid_serving:
                raise
            self._leave_eager(key, lora, attn, exc)
            return
        t3 = time.perf_counter()
        self.capture_seconds["eager"] += t2 - t1
        self.capture_seconds["record"] += t3 - t2
        logger.debug(
            "graph %s %d (LoRA %s, variant %d): eager %.1f ms, record %.1f ms",
            *(kind, size, lora, attn, (t2 - t1) * 1e3, (t3 - t2) * 1e3),
        )

    def _leave_eager(self, key: GraphKey, lora: bool, attn: int, exc: BaseException) -> None:
        """A capture mid-serving failed: its bucket runs eagerly from now on, with a warning."""
        self._planned.discard((key, lora, attn))
        logger.warning("capturing the CUDA graph of %s %d failed (%s): its steps run eagerly", *key, exc)

    def _capture_tails(self, tail: Callable[[torch.Tensor], None], sizes: list[int]) -> None:
        assert self._logits is not None
        for size in sizes:
            view = self._logits(size)
            tail(view)  # compiles, and settles the allocator, before capture
            torch.cuda.synchronize(self.device)
            self._tails[size] = self._record(functools.partial(tail, view))

    def _record(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """A graph of `fn` in the shared pool, captured on a side stream (the device idle: the eager run
        before it was waited for). What `torch.cuda.graph` does, less the emptying of the allocator's caches
        (device and pinned host) it starts every capture with. At start-up that handed each eager run's
        activations back to the driver for the next to allocate again (no measurable cost on an H100:
        bench/RESULTS.md, eleventh session); a lazy capture mid-serving would also drop the pinned blocks
        the KV tiers' copies keep cached, whose next allocation waits for the whole device."""
        graph = torch.cuda.CUDAGraph()
        stream = self._stream
        if stream is None:
            stream = self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        collecting = gc.isenabled()
        gc.disable()  # no finalizer of a serving heap's garbage runs inside the capture (a lazy one)
        try:
            with torch.cuda.stream(stream):
                # thread_local: another thread's CUDA call (NCCL's watchdog querying an earlier collective's
                # event, under tensor parallelism) must not invalidate this capture.
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    def release(self) -> None:
        """Drop the graphs (and their pool) and this runner's hold on the KV cache."""
        self._graphs.clear()
        self._planned.clear()
        self._tails.clear()
        self._logits = None
        self._pool = None
        self.kv_caches = []


def _dummy_decode(size: int) -> SchedulerOutput:
    """`size` one-token sequences at position 0 in block 0; capture overwrites its KV slot, never read."""
    return SchedulerOutput(seqs=[ScheduledSeq(f"capture-{i}", [0], 0, [0], True) for i in range(size)])


def _dummy_mixed(block_size: int) -> SchedulerOutput:
    """A two-token prompt in block 0 (capture overwrites it, never read), padded by the caller. Only launch
    shapes are captured: both attention kernels launch whatever the step holds, over the work list the
    backend rewrites per step."""
    return SchedulerOutput(seqs=[ScheduledSeq("capture-0", [0, 0], 0, [0] * -(-2 // block_size), True)])
