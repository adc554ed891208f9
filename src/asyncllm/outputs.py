"""What a request gives back: streamed chunks and the whole result, and the one accumulator that joins a
request's deltas into them (for the stream's mailbox, `collect`, `LLM.generate` and the server alike).
Plain Python; no torch, and nothing of the engine core or of event loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from asyncllm.errors import AsyncLLMError, InvalidRequestError

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


class OutputAccumulator:
    """One request's output, joined from its deltas in order: the one place where streamed pieces add up.

    `add` joins one delta: its text, token ids and logprobs (when asked for) are appended; a final delta
    closes the request, with its finish reason and metrics, or with the `error` that ended this request
    alone (then no finish reason is kept: the reader raises the error after the output before it). What
    is added after that is ignored: the first final output wins (an abort that raced a finish). Read it
    whole (`text`, `token_ids`, `logprobs`, `result`), or in chunks: `take_chunk` hands out what was joined
    since the previous take as one `StreamOutput`, so a consumer that lags gets several deltas merged.

    Not thread-safe: the owner guards it (a stream's mailbox takes its lock around `add` and `take_chunk`).
    """

    __slots__ = ("error", "finish_reason", "finished", "logprobs", "metrics", "texts", "token_ids")

    def __init__(self) -> None:
        self.texts: list[str] = []  # text pieces not yet taken (every piece, if never taken), joined on read
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None  # only for requests that asked for them
        self.finish_reason: FinishReason | None = None
        self.metrics: RequestMetrics | None = None  # set with the finish reason
        self.error: str | AsyncLLMError | None = None  # why this request alone failed (see `request_error`)
        self.finished = False  # a final delta was added (or the owner ended it): later deltas are ignored

    def add(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: FinishReason | None = None,
        metrics: RequestMetrics | None = None,
        error: str | AsyncLLMError | None = None,
    ) -> None:
        """Join one delta (the fields by position: the stream's mailbox calls this per request per step)."""
        if self.finished:
            return
        self.token_ids.extend(token_ids)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        if text:
            self.texts.append(text)
        if error is not None:
            self.error = error
            self.finished = True
        elif finish_reason is not None:
            self.finish_reason = finish_reason
            self.metrics = metrics
            self.finished = True

    def add_chunk(self, chunk: StreamOutput) -> None:
        """Join a chunk a stream handed out."""
        self.add(chunk.text, chunk.token_ids, chunk.logprobs, chunk.finish_reason, chunk.metrics)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def take_chunk(self, request_id: str) -> StreamOutput | None:
        """What was joined since the previous take, as one chunk (the final one carries the finish reason and
        metrics), or None when nothing new is there; the text, token ids and logprobs taken are dropped."""
        if not (self.token_ids or self.texts or self.finish_reason is not None):
            return None
        out = StreamOutput(
            request_id=request_id,
            text="".join(self.texts),
            token_ids=tuple(self.token_ids),
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
        )
        self.token_ids = []
        self.texts = []
        self.logprobs = None
        return out

    def result(self, request_id: str, prompt_token_ids: list[int]) -> RequestOutput:
        """The whole output, once every delta was added (and none taken); raises `InvalidRequestError` for a
        request that failed alone (or `RequestFailedError`, see `request_error`), as its stream does."""
        if self.error is not None:
            raise request_error(self.error)
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            text=self.text,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            logprobs=self.logprobs,
        )


def request_error(error: str | AsyncLLMError) -> AsyncLLMError:
    """What a request that failed alone raises (a fresh instance per reader, so tracebacks stay apart): a
    str says what was wrong with the request (`InvalidRequestError`); an error instance is raised as its own
    kind, cause kept (`RequestFailedError`: the engine failed that request)."""
    if isinstance(error, str):
        return InvalidRequestError(error)
    fresh = type(error)(*error.args)
    fresh.__cause__ = error.__cause__
    return fresh
