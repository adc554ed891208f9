"""`Request`: one generation request as the engine core tracks it.

Owns the token sequence and the progress counters the scheduler works from; knows nothing of tensors,
event loops or clocks (timestamps are passed in).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asyncllm.outputs import FinishReason
from asyncllm.pooling import PoolingParams
from asyncllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again; its KV was dropped and is recomputed on resume
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    """A request's token state. The scheduler's one rule: `num_computed_tokens` catches up with
    `num_planned_tokens` (the known tokens plus those sampled by steps still in flight); a step that
    reaches it samples the next token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_tokens: int  # resolved: params.max_tokens capped by max_model_len - prompt length
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first (vLLM's convention)
    lora_name: str | None = None  # the LoRA adapter the caller named; None: the base model
    deadline: float | None = None  # on the engine's clock: not finished by then, it ends ("timeout")
    # An embed or score engine's request (core/pooling.py): its whole prompt runs in one step, whose output
    # (its vector) ends it; `params` are the defaults and `max_tokens` 1, so it samples nothing else.
    pooling: PoolingParams | None = None

    arrival_index: int = 0  # set by the scheduler: requests added before this one (the order within a priority)

    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0  # sampled by submitted steps whose outputs are not processed yet
    # Submitted draws whose token is known already (the first of a forced run, jump-forward): appended, not
    # pending; their output is dropped when it comes.
    num_drawn_ahead: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)  # token t's KV in entry t // block_size (window_blocks.py)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, computed lazily
    block_digests: list[bytes] = field(default_factory=list)  # their 128-bit twins, with a disk tier only
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # On each sample of a request with n > 1: that request's id, its `SampleGroup`'s key (sample_group.py).
    group_id: str | None = None
    # SamplingParams.prompt_logprobs: the prompt's logprobs scored so far (None for the first token), until
    # they go out with the first sampled token; None for requests that did not ask, and once they went out.
    prompt_logprobs: list[dict[int, float] | None] | None = field(init=False)
    lora_id: int = 0  # `lora_name`'s adapter, resolved by the core (0: none); part of its prefix hashes
    # Its decodes may carry drafts (speculative decoding: the engine speculates, and every feature the request
    # asks for is one verification keeps exact). While the engine speculates (few requests run: scheduler.py),
    # such a request is never planned while a step of it is in flight: its next step starts from the tokens
    # that step accepted.
    speculative: bool = False
    # Steps verifying drafts of it in flight: its next step waits for the tokens they accept, unless it is
    # chained on the latest (core/spec/chain.py), whose drafts are `drafts_in_flight`.
    num_verifying: int = 0
    drafts_in_flight: list[int] = field(default_factory=list)
    # The drafts of its step in flight that its latest (chained) step assumed accepted (0: none chained), and
    # its chained steps in flight found void (their outputs are dropped as they come).
    chained_on: int = 0
    num_void: int = 0
    # A draw of it sat out (`sit_out`): from then on it is never planned while a step of it is in flight either.
    sits_out: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """Its prompt logprobs are still owed: every prompt position must be computed for it (no prefix hit)."""
        return self.prompt_logprobs is not None

    @property
    def has_enough_tokens(self) -> bool:
        """Its last token is known or on its way (max_tokens reached counting those in flight): nothing more
        is worth computing for it."""
        return self.num_output_tokens + self.num_pending_tokens >= self.max_tokens

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def sit_out(self) -> None:
        """Its oldest draw in flight sat out (`ModelRunnerOutput.deferred`: its constraint's mask was not filled
        in time): no token. Its next step computes its last known token again, for the logits it draws from. A
        step planned before this one was read follows the token that never came: that draw's output, and this
        one's, are dropped as they come, as a forced run's drawn-ahead token is."""
        self.sits_out = True
        self.num_computed_tokens = min(self.num_computed_tokens, len(self.all_token_ids) - 1)
        self.num_drawn_ahead += self.num_pending_tokens
        self.num_pending_tokens = 0
