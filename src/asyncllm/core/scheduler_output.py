"""What one step asks the model runner to do: plain data, so it can later cross a process boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

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
