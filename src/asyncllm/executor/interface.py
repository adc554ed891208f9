"""The contract between the engine core and whatever executes the model: plain data and one protocol.

The core schedules a `SchedulerOutput`, an executor (in-process now, tensor-parallel workers later) runs it
and returns a `ModelRunnerOutput`; `RuntimeInfo` carries the facts the executor learned when it loaded the
model and sized the KV cache. Plain Python, no torch: this is what may cross a process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from asyncllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, the first time a request is scheduled: what the runner keeps per request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn from the engine seed: every request samples from its own generator


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's slice of a step: compute KV for `input_token_ids` at positions `start_pos`...

    `block_ids` is the request's whole block table after this step's allocation. `sample` is True when the
    slice reaches the end of the known tokens, so its last logits give the next token.
    """

    request_id: str
    input_token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens whose KV exists once this step has run."""
        return self.start_pos + len(self.input_token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops their state
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One sampled token for each `ScheduledSeq` with `sample=True`, in the order of `seqs`."""

    sampled_token_ids: list[int]
    # Per sampled token: {token id: logprob} with the sampled token and the top `logprobs` alternatives.
    logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts learned when the model is loaded and the KV cache sized: runtime state, never config."""

    vocab_size: int  # rows of the embedding: valid token ids are [0, vocab_size)
    max_model_len: int  # the configured (or model's) limit on prompt + output tokens
    num_kv_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    device: str  # "cpu" or "cuda:N"
    dtype: str  # "float32", "bfloat16", ...
    attention_backend: str = "torch"  # the backend that runs ("torch", "triton", ...), after "auto" resolved
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batch sizes replayed from CUDA graphs; () when eager
    startup_seconds: tuple[tuple[str, float], ...] = ()  # (step, seconds): load, profile, warm_up, capture

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_seq_len(self) -> int:
        """The longest sequence that can actually run: the model limit or the whole KV cache, if smaller."""
        return min(self.max_model_len, self.kv_capacity_tokens)


class ModelExecutor(Protocol):
    """What the engine core drives: implemented in-process (`executor.uniproc`), by test doubles, and later
    by tensor-parallel workers. The core sees only the plain data above."""

    @property
    def runtime(self) -> RuntimeInfo: ...

    def execute_model(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: write KV for every scheduled token, sample where `sample` is set."""
        ...

    def shutdown(self) -> None:
        """Release device memory. Idempotent."""
        ...
