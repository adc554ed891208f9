"""The step contract between the engine core and whatever executes the model: plain data and one protocol.

The core schedules a `SchedulerOutput`; an executor (in-process, tensor-parallel worker processes, or a test
double) starts it with `submit` and hands back a `StepResult` whose `result()` is the `ModelRunnerOutput`;
`RuntimeInfo` carries the facts the executor learned when it loaded the model and sized the KV cache. Steps
run in the order submitted, so a step may be planned while the previous one runs: a token that previous step
will sample is named by `PLACEHOLDER` and the executor feeds it in from that step's output.

Sits below both sides (the core above, the executors and workers below) and imports only the foundation:
plain Python, no torch, so it is also what may cross a process boundary. A new per-step field (a sampling
parameter's data, a grammar's mask row) is declared here first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from asyncllm.config_values import Task
from asyncllm.errors import AsyncLLMError
from asyncllm.pooling import PoolerSpec, PoolingParams
from asyncllm.sampling_params import SamplingParams

# An input token sampled by the step submitted just before this one, not yet known to the host: the executor
# takes it from that step's output (on the device, with no round trip). Only a sequence's last input can be.
PLACEHOLDER = -1


@dataclass(frozen=True)
class NewRequestData:
    """Sent once, the first time a request is scheduled: what the runner keeps per request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn from the engine seed: every request samples from its own generator
    lora_id: int = 0  # the LoRA adapter its tokens go through (`LoRAAdapter.lora_id`); 0: the base model
    pooling: PoolingParams | None = None  # an embed or score engine's request: pooled, never sampled
    speculative: bool = False  # its decodes may carry drafts (a draft model proposes after its steps)


@dataclass(frozen=True)
class LoRAAdapter:
    """A LoRA adapter as the core hands it to an executor (`ModelExecutor.add_lora`): `lora_id` is unique for
    the engine's lifetime (an adapter removed and added again under its name gets a new one, so no prefix
    cached for the old weights is ever served for the new), `path` a PEFT adapter directory."""

    lora_id: int
    name: str
    path: str


# Not frozen: one is built per sequence per step, and a frozen dataclass's __init__ costs about three times a
# slotted one's (bench/RESULTS.md, host_step). Executors and runners only read it.
@dataclass(slots=True)
class ScheduledSeq:
    """One request's slice of a step: compute KV for `input_token_ids` at positions `start_pos`...

    `block_ids` is the request's whole block table after this step's allocation (when every layer slides, its
    leading entries may name blocks already given back: no kernel reads them again). `sample` is True when the
    slice reaches the end of the request's tokens (those known and the one in flight), so its last logits
    give the next token. The last input id may be `PLACEHOLDER`.
    """

    request_id: str
    input_token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    # Speculative decoding: the last this many inputs are drafts, verified by this step (logits at each of
    # the last 1 + num_drafts positions); their KV past the accepted ones is garbage, overwritten later.
    num_drafts: int = 0
    # Planned while the request's previous step, verifying drafts, was in flight, as if it accepts all of them
    # (its input before the drafts is that step's last token, a PLACEHOLDER): void, and its draws given back,
    # unless it does (core/spec/chain.py).
    chained: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens whose KV exists once this step has run."""
        return self.start_pos + len(self.input_token_ids)

    @property
    def takes_previous_token(self) -> bool:
        """Its last input before its drafts is the token the previous step samples for this request."""
        return self.input_token_ids[-1 - self.num_drafts] == PLACEHOLDER


@dataclass(frozen=True)
class KVTransfers:
    """A step's copies of KV blocks between the device and the tiers below it (`core/kv_tiers.py`), in the
    order every rank runs them, each rank its own shard. Before the forward pass: `offloads` (device block ->
    host slot: the block is taken for other content by this step), `loads` (block hash -> host slot, read from
    the disk tier beside the steps, with the 128-bit digest of the prefix the file must hold; a later step's
    output says which arrived, `ModelRunnerOutput.kv_loaded`), `restores` (host slot -> device block, for a
    request that computes from the next step on: the forward pass of this step does not wait for them, every
    later step's work does). After it is launched: `ahead` (device block -> host slot: free cached blocks copied
    before the pool takes them, overlapping the forward pass). `writes` (block hash -> host slot, with its
    prefix's digest): filled slots to keep on disk too, written in the background. `wait`: the forward pass
    waits for every copy to the host issued before (it overwrites a block an earlier step's `ahead` copies)."""

    offloads: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int, bytes]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    ahead: list[tuple[int, int]] = field(default_factory=list)
    writes: list[tuple[int, int, bytes]] = field(default_factory=list)
    wait: bool = False

    @property
    def before_forward(self) -> bool:
        """Copies the forward pass must wait for (and the step's restores follow)."""
        return bool(self.offloads or self.wait)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops their state
    preempted_request_ids: list[str] = field(default_factory=list)
    num_draft_tokens: int = 0  # the sum of the seqs' `num_drafts`: 0 unless the step verifies drafts
    kv: KVTransfers | None = None  # copies to and from the KV tiers below the device (None: none)
    # Speculative decoding: whether the runner's draft model (if any) proposes after this step for its speculative
    # rows; False while speculation pauses (many running requests: scheduler.py).
    propose_drafts: bool = True

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        """Nothing to run: no sequence and no copy (a step of copies alone runs no model)."""
        return not self.seqs and self.kv is None


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One sampled token for each `ScheduledSeq` with `sample=True`, in the order of `seqs` (and, verifying
    drafts, the tokens accepted after it: `accepted`)."""

    sampled_token_ids: list[int]
    # Per sampled token: {token id: logprob} with the sampled token and the top `logprobs` alternatives.
    logprobs: list[dict[int, float] | None] | None = None
    # Sample index -> why that request cannot go on: the core ends it with this error instead of outputting
    # the token. A str is the request's own doing (its output constraint allows no token here: raised as
    # `InvalidRequestError`); an error instance is the engine's failure of that request alone (raised as
    # itself, e.g. `RequestFailedError`). None (the rule): every row went well.
    failed: dict[int, str | AsyncLLMError] | None = None
    # Request id -> {token id: logprob} for each prompt token this step scored, in prompt order
    # (SamplingParams.prompt_logprobs: the prompt token and the top alternatives). None: no request asked.
    prompt_logprobs: dict[str, list[dict[int, float]]] | None = None
    # Sample index -> the tokens its request's output constraint forces right after that row's token
    # (jump-forward), in order: the core appends them as output tokens, computed by the request's next step.
    # Where the request's next draw was already submitted (overlapped scheduling), that draw is the run's
    # first token (its mask allows it alone). None: no run this step.
    forced: dict[int, list[int]] | None = None
    # Sample index -> the tokens after that row's token that the step verified (speculative decoding): the
    # row's token equalled its first draft, and so on; the last is the target's own token after the drafts
    # it agreed with. Its length is the drafts accepted. None or a row left out: none accepted.
    accepted: dict[int, list[int]] | None = None
    # Sample index -> the logprobs of its `accepted` tokens, one entry each (requests asking for logprobs).
    accepted_logprobs: dict[int, list[dict[int, float] | None]] | None = None
    # Sample index -> a draft model's proposals to follow that row's last token (its accepted run's last, if
    # any): the core keeps them for the request's next decode (speculative_config's "draft_model"). None: none.
    drafts: dict[int, list[int]] | None = None
    # Sample indices whose draw sat out (their constraint's next mask was still being filled beside the step:
    # structured_output/deferral.py): no token for that request this step. The core has it compute its last
    # known token again, and plans it no more while a step of it is in flight. None: every row drew.
    deferred: list[int] | None = None
    # An embed or score engine's step (no token sampled): per sampling sequence, in order, its embedding or
    # its one-value score. None: a generation step.
    pooled: list[list[float]] | None = None
    # Disk reads finished on every rank since the last step that reported some: the oldest reads not reported
    # yet, in the order the steps sent them (`KVTransfers.loads`, step after step), each whether its block
    # reached its host slot intact on every rank. None: none finished.
    kv_loaded: tuple[bool, ...] | None = None


@dataclass(frozen=True)
class KVTierInfo:
    """The KV tiers below the device as the worker set them up (`kv_offloading_size`, `kv_cache_dir`)."""

    host_blocks: int  # host slots, each holding one block (every rank holds its shard of each)
    ahead_blocks: int  # free cached blocks a step may copy to the host before the pool takes them
    disk_blocks: int = 0  # the most blocks the disk tier keeps (0: no disk tier)
    loads_per_step: int = 0  # disk blocks one step may read
    restores_per_step: int = 0  # host blocks one step may restore, past its first request's (0: no bound)
    on_disk: tuple[int, ...] = field(default=(), repr=False)  # hashes the disk tier held at start, oldest first


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
    # decode batch sizes replayed from CUDA graphs (captured at start-up, or by the first step of each:
    # ASYNCLLM_CUDA_GRAPH_CAPTURE=lazy); () when eager
    cuda_graph_sizes: tuple[int, ...] = ()
    cuda_graph_token_sizes: tuple[int, ...] = ()  # token counts of the other steps' graphs; () when none
    cuda_graphs_pending: int = 0  # lazy capture: graphs not captured at start-up (`ModelExecutor.pending_graphs`)
    # (phase, seconds) in order; from `build_engine` they cover the whole build (see asyncllm.startup).
    startup_seconds: tuple[tuple[str, float], ...] = ()
    architecture: str = ""  # the checkpoint's, e.g. "Qwen3ForCausalLM"
    kv_cache_bytes: int = 0  # the KV cache's memory (one rank's share under tensor parallelism)
    num_threads: int | None = None  # torch's CPU threads in the thread that runs steps (rank 0's)
    max_loras: int = 0  # LoRA adapter slots (the most one batch mixes); 0: built without enable_lora
    gemv_layers: int = 0  # linear layers whose one-token-row steps take the one-launch GEMV (ASYNCLLM_DECODE_GEMV)
    prologue_layers: int = 0  # of those, the ones folding the norm or SiLU-and-mul before them into it
    decode_layers: int = 0  # decoder layers whose small decode steps run as one launch (ASYNCLLM_DECODE_LAYER)
    # When every layer of the model slides over at most this many keys (Mistral's sliding_window): keys that
    # far behind a sequence's next token are never read again, and their blocks can be given back early.
    # None: some layer reads every key.
    kv_window: int | None = None
    kv_tiers: KVTierInfo | None = None  # None: no tier below the device (kv_offloading_size=0, no kv_cache_dir)
    task: Task = Task.GENERATE  # what the engine serves, resolved from `task` and the checkpoint
    pooler: PoolerSpec | None = None  # an embed or score engine's pooler (None: generation)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_seq_len(self) -> int:
        """The longest sequence that can actually run: the model limit or the whole KV cache, if smaller."""
        return min(self.max_model_len, self.kv_capacity_tokens)


class StepResult(Protocol):
    """A submitted step: `result()` waits for it (and every step submitted before it). A step may hold part
    of its work back on the host (a constrained draw waiting for its mask, launched by the next submit):
    it is not `done()` until something launched it, and `start()` or `result()` does."""

    def done(self) -> bool:
        """The output is ready: `result()` will not wait."""
        ...

    def start(self) -> None:
        """Launch whatever of the step the host still holds back; never waits for the device. Idempotent."""
        ...

    def result(self) -> ModelRunnerOutput: ...


@dataclass(frozen=True)
class ReadyStep:
    """The `StepResult` of an executor that ran the step synchronously."""

    output: ModelRunnerOutput

    def done(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def result(self) -> ModelRunnerOutput:
        return self.output


class ModelExecutor(Protocol):
    """What the engine core drives: implemented in-process (`executor.uniproc`), by test doubles, and later
    by tensor-parallel workers. The core sees only the plain data above."""

    @property
    def runtime(self) -> RuntimeInfo: ...

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        """Start one step (write KV for every scheduled token, sample where `sample` is set) after every
        step submitted before it; returns at once when the device runs it asynchronously."""
        ...

    def shutdown(self) -> None:
        """Release device memory. Idempotent."""
        ...

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Have `callback` called, from any thread and at most once, when the executor fails between steps
        (a tensor-parallel worker dies while the engine idles); a failure during a step raises from it."""
        ...

    def add_lora(self, adapter: LoRAAdapter) -> None:
        """Load `adapter` on every rank, between steps (steps submitted before it are unaffected; later ones
        may name it in `NewRequestData.lora_id`). Raises `LoRAError`, changing nothing, for an adapter that
        cannot serve this model (format, rank, target modules, shapes)."""
        ...

    def remove_lora(self, lora_id: int) -> None:
        """Forget an adapter no live request uses (steps already submitted may still run with it)."""
        ...

    def pending_graphs(self, capture_one: bool = False) -> int:
        """How many CUDA graphs lazy capture left for later are still pending (`RuntimeInfo.cuda_graphs_pending`;
        asked only where that was not 0). `capture_one` (no step in flight): capture the next one first."""
        ...
