"""`Buckets`: the shapes steps are padded and planned to, and which one a step takes (`shape`).

Whenever the attention backend plans statically, a decode-only step is padded to a batch-size bucket and any
other step (prompt chunks, with or without decodes) to a token-count bucket, and planned for it; each bucket
is a CUDA graph's shape, replayed when one was captured and run eagerly the same way otherwise, so graphs and
`enforce_eager` compute exactly the same numbers. Steps beyond the largest bucket, and every step of a
backend that cannot plan statically, run eagerly, unpadded. Knows nothing of the model or of capture.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

from asyncllm.attention.backend import AttentionBackend, PlanBounds
from asyncllm.step import SchedulerOutput
from asyncllm.worker.input_batch import WorkRoom

GraphKey = tuple[Literal["decode", "mixed"], int]  # a bucket: its kind and its size (sequences, or tokens)


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


@dataclass(frozen=True)
class StepShape:
    """How one step runs. `graph`: the bucket it is padded to (its CUDA graph replays it when captured);
    None: eager and unpadded, planned for itself (`bounds` None)."""

    graph: GraphKey | None
    bounds: PlanBounds | None  # what the attention backend plans for
    pad_to: int | None  # a decode bucket: dummy one-token sequences up to this many rows
    pad_tokens_to: int | None  # a mixed bucket: rows of no sequence up to this many tokens
    logit_rows: int  # rows the LM head runs at (a decode bucket, the counts warm-up ran)
    # Whether the sampled rows are gathered from the hidden states (`logits_indices`, padded to logit_rows);
    # a decode bucket's hidden rows are its sequences', in order, every one sampling: no gather.
    gathers_logits: bool

    @property
    def pad_logits_to(self) -> int | None:
        return self.logit_rows if self.gathers_logits else None


class Buckets:
    def __init__(
        self,
        backend: AttentionBackend,
        decode_sizes: list[int],
        token_sizes: list[int],
        max_num_seqs: int,
        max_num_tokens: int,
        max_seq_len: int,
    ) -> None:
        if (decode_sizes or token_sizes) and not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name!r} attention backend cannot plan statically: no buckets")
        self.backend = backend
        self.decode_sizes = decode_sizes  # ascending
        self.token_sizes = token_sizes  # ascending
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens  # the step budget
        self.max_seq_len = max_seq_len  # static bound on sequence lengths: plans depend on nothing else
        self._bounds = {key: self._make_bounds(key) for key in self.graph_keys}
        # Decode shapes are made once: the decode step's host path is the hot one.
        self._decode = {n: self._shape(("decode", n), n) for n in decode_sizes}

    @classmethod
    def for_engine(
        cls, backend: AttentionBackend, max_num_seqs: int, max_num_tokens: int, max_graph_tokens: int, max_seq_len: int
    ) -> Buckets:
        """Every bucket an engine's steps may use: decode steps hold at most one token per sequence within the
        step's token budget; other steps are padded up to `max_graph_tokens` (0: none; they run unpadded)."""
        if not backend.supports_cuda_graphs:
            return cls(backend, [], [], max_num_seqs, max_num_tokens, max_seq_len)
        decode = capture_sizes(min(max_num_seqs, max_num_tokens))
        tokens = token_capture_sizes(min(max_graph_tokens, max_num_tokens))
        return cls(backend, decode, tokens, max_num_seqs, max_num_tokens, max_seq_len)

    def largest(self) -> Buckets:
        """The largest decode and token buckets alone (the graphs' memory is measured on them)."""
        return Buckets(
            self.backend,
            self.decode_sizes[-1:],
            self.token_sizes[-1:],
            self.max_num_seqs,
            self.max_num_tokens,
            self.max_seq_len,
        )

    @property
    def graph_keys(self) -> list[GraphKey]:
        return [("decode", n) for n in self.decode_sizes] + [("mixed", n) for n in self.token_sizes]

    def bounds(self, key: GraphKey) -> PlanBounds:
        return self._bounds[key]

    def _make_bounds(self, key: GraphKey) -> PlanBounds:
        kind, size = key
        if kind == "decode":
            return PlanBounds(size, size, self.max_seq_len, decode_only=True)
        return PlanBounds(size, self.max_num_seqs, self.max_seq_len)

    def work_room(self) -> WorkRoom:
        """Room for the attention work lists: the longest any bucket's static plan holds (at one fixed
        address), and the longest of a step planned alone within the step budget."""
        backend = self.backend
        static = max((backend.work_size(self.bounds(key)) for key in self.graph_keys), default=0)
        step = backend.work_size(PlanBounds(self.max_num_tokens, self.max_num_seqs, self.max_seq_len))
        return WorkRoom(static, step, backend.work_dtype)

    def shape(self, scheduled: SchedulerOutput, num_sampling: int) -> StepShape:
        """The shape a step of `num_sampling` sampled sequences runs at."""
        if is_decode_only(scheduled):
            size = _next(self.decode_sizes, len(scheduled.seqs))
            if size is not None:
                return self._decode[size]
        tokens = _next(self.token_sizes, scheduled.num_batched_tokens)
        if tokens is None:
            return StepShape(None, None, None, None, self.logit_rows(num_sampling), gathers_logits=True)
        return self._shape(("mixed", tokens), num_sampling)

    def logit_rows(self, num_sampling: int) -> int:
        """Rows the LM head runs at for a step sampling `num_sampling` sequences: the next decode bucket (the
        counts warm-up ran), or exactly `num_sampling` where there are no buckets. The LM head runs outside
        the graphs (but in decode graphs with ASYNCLLM_CUDA_GRAPH_SAMPLING), and cuBLAS sets up a kernel per new row
        count on first use."""
        i = bisect.bisect_left(self.decode_sizes, num_sampling)
        return self.decode_sizes[i] if num_sampling and i < len(self.decode_sizes) else num_sampling

    def _shape(self, key: GraphKey, num_sampling: int) -> StepShape:
        kind, size = key
        if kind == "decode":
            return StepShape(key, self.bounds(key), size, None, size, gathers_logits=False)
        return StepShape(key, self.bounds(key), None, size, self.logit_rows(num_sampling), gathers_logits=True)


def _next(sizes: list[int], n: int) -> int | None:
    """The smallest of `sizes` that holds n; None past the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
