"""What a request gives back: streamed chunks and the whole result. Plain Python; no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]
# Per generated token, when SamplingParams.logprobs is set: {token id: log-probability} holding the sampled
# token and the `logprobs` most likely alternatives, over the model's raw (unprocessed) distribution.
TokenLogprobs = dict[int, float]


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies in seconds, measured from the moment the request was added."""

    time_to_first_token: float | None
    e2e_latency: float | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True)
class StreamOutput:
    """One chunk of a stream: what is new since the previous chunk.

    Concatenating every chunk's `text` gives the final text exactly; a lagging consumer receives several
    steps merged into one chunk.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    metrics: RequestMetrics | None = None  # set on the final chunk only
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token in `token_ids`, if asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """The whole result of one request."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    metrics: RequestMetrics | None
    logprobs: list[TokenLogprobs] | None = None  # one per token in `token_ids`, if asked for
