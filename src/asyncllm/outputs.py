"""What a request gives back: streamed chunks and the whole result, and the accumulators that join a
request's deltas into them (for the stream's mailbox, `collect`, `LLM.generate` and the server alike): one
per sample, and for `n` > 1 one that keeps the samples apart. Plain Python; no torch, and nothing of the
engine core or of event loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from asyncllm.errors import AsyncLLMError, InvalidRequestError

FinishReason = Literal["stop", "length", "abort", "timeout"]
# Per generated token, when SamplingParams.logprobs is set: {token id: log-probability} holding the sampled
# token and the `logprobs` most likely alternatives, over the model's raw (unprocessed) distribution.
TokenLogprobs = dict[int, float]
# When SamplingParams.prompt_logprobs is set: one entry per prompt token, None for the first (nothing precedes
# it), then {token id: log-probability} holding that prompt token and the `prompt_logprobs` most likely ones.
PromptLogprobs = list[TokenLogprobs | None]


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
    steps merged into one chunk. With `SamplingParams.n` > 1, `index` says which sample (0..n-1) the chunk
    belongs to (a chunk never mixes samples); `finish_reason` ends that sample, and the stream ends once
    every sample has ended. `prompt_logprobs` (when asked for) arrive once, whole, on the stream's first chunk
    (with n > 1: whichever sample's it is; they are the request's); every other chunk has None.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    metrics: RequestMetrics | None = None  # set on the final chunk only
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token in `token_ids`, if asked for
    index: int = 0  # the sample (0..n-1) this chunk belongs to
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # on the first chunk only, if asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class CompletionOutput:
    """One sample's whole output: `RequestOutput.outputs[index]`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None = None  # one per token in `token_ids`, if asked for
    metrics: RequestMetrics | None = None  # this sample's own (its first token, its end, its tokens)


@dataclass(frozen=True)
class RequestOutput:
    """The whole result of one request.

    `outputs` holds every sample (`SamplingParams.n` of them, by index). `text`, `token_ids`,
    `finish_reason` and `logprobs` are sample 0's, so code written for one sample reads the same fields;
    `metrics` covers the whole request (for n > 1: the first token of any sample, the end of the last, every
    sample's tokens counted, the prompt counted once). `prompt_logprobs` are the request's (one per prompt
    token, None first), whatever `n` is.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    metrics: RequestMetrics | None
    logprobs: list[TokenLogprobs] | None = None  # one per token in `token_ids`, if asked for
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # if asked for (SamplingParams.prompt_logprobs)


class OutputAccumulator:
    """One request's output, joined from its deltas in order: the one place where streamed pieces add up.

    `add` joins one delta: its text, token ids and logprobs (when asked for) are appended, and its prompt
    logprobs (on the request's first delta, when asked for) kept; a final delta closes the request, with
    its finish reason and metrics, or with the `error` that ended this request
    alone (then no finish reason is kept: the reader raises the error after the output before it). What
    is added after that is ignored: the first final output wins (an abort that raced a finish). Read it
    whole (`text`, `token_ids`, `logprobs`, `prompt_logprobs`, `result`), or in chunks: `take_chunk` hands out
    what was joined since the previous take as one `StreamOutput`, so a consumer that lags gets several deltas
    merged (the prompt logprobs go out with the first chunk taken after they came).

    Not thread-safe: the owner guards it (a stream's mailbox takes its lock around `add` and `take_chunk`).
    """

    __slots__ = ("error", "finish_reason", "finished", "logprobs", "metrics", "prompt_logprobs", "texts", "token_ids")

    def __init__(self) -> None:
        self.texts: list[str] = []  # text pieces not yet taken (every piece, if never taken), joined on read
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None  # only for requests that asked for them
        self.finish_reason: FinishReason | None = None
        self.metrics: RequestMetrics | None = None  # set with the finish reason
        self.error: str | AsyncLLMError | None = None  # why this request alone failed (see `request_error`)
        self.finished = False  # a final delta was added (or the owner ended it): later deltas are ignored
        self.prompt_logprobs: PromptLogprobs | None = None  # not taken yet, for requests that asked for them

    def add(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: FinishReason | None = None,
        metrics: RequestMetrics | None = None,
        error: str | AsyncLLMError | None = None,
        index: int = 0,
        prompt_logprobs: Sequence[TokenLogprobs | None] | None = None,
    ) -> None:
        """Join one delta (the fields by position: the stream's mailbox calls this per request per step).
        `index`, the delta's sample, is for `SamplesAccumulator`: one accumulator holds one sample."""
        if self.finished:
            return
        if prompt_logprobs is not None:
            self.prompt_logprobs = list(prompt_logprobs)
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
        self.add(
            chunk.text,
            chunk.token_ids,
            chunk.logprobs,
            chunk.finish_reason,
            chunk.metrics,
            None,
            0,
            chunk.prompt_logprobs,
        )

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def take_chunk(self, request_id: str, index: int = 0) -> StreamOutput | None:
        """What was joined since the previous take, as one chunk (the final one carries the finish reason and
        metrics), or None when nothing new is there; the text, token ids and logprobs taken are dropped.
        `index`: the sample the chunk is labelled with."""
        if not (self.token_ids or self.texts or self.finish_reason is not None):
            return None  # (prompt logprobs come with a token: never alone)
        prompt, self.prompt_logprobs = self.prompt_logprobs, None
        out = StreamOutput(
            request_id=request_id,
            text="".join(self.texts),
            token_ids=tuple(self.token_ids),
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
            index=index,
            prompt_logprobs=tuple(prompt) if prompt is not None else None,
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
        return _request_output(request_id, prompt_token_ids, [self.completion(0)], self.metrics, self.prompt_logprobs)

    def completion(self, index: int) -> CompletionOutput:
        """The whole output as sample `index` of a `RequestOutput`."""
        return CompletionOutput(index, self.text, self.token_ids, self.finish_reason, self.logprobs, self.metrics)

    def is_last(self, chunk: StreamOutput) -> bool:
        """`chunk`, just taken with a finish reason, ends the stream (one sample: always)."""
        return True


class SamplesAccumulator:
    """The output of a request with n > 1 samples: one `OutputAccumulator` per sample, so chunks never mix
    samples. The same calls as `OutputAccumulator` (`add` routes a delta by its `index`); `take_chunk` hands
    out one sample's merged chunk at a time, samples in the order their output arrived. Finished once every
    sample has finished, or at once when a delta carries the `error` that ends the whole request (every
    sample's output so far stays readable first; the failing sample's keeps no finish reason). The prompt
    logprobs are the request's, whichever sample's delta brought them: the next chunk taken carries them.
    """

    __slots__ = ("complete", "error", "finished", "num_open", "pending", "prompt_logprobs", "samples")

    def __init__(self, n: int) -> None:
        self.samples = [OutputAccumulator() for _ in range(n)]
        self.pending: dict[int, None] = {}  # samples with output not taken yet, in arrival order
        self.num_open = n  # samples without their finish reason
        self.error: str | AsyncLLMError | None = None
        self.finished = False
        self.complete = False  # every sample finished and every chunk was taken: the stream is over
        self.prompt_logprobs: PromptLogprobs | None = None  # the request's, not taken yet

    def add(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
        finish_reason: FinishReason | None = None,
        metrics: RequestMetrics | None = None,
        error: str | AsyncLLMError | None = None,
        index: int = 0,
        prompt_logprobs: Sequence[TokenLogprobs | None] | None = None,
    ) -> None:
        sample = self.samples[index]
        if self.finished or sample.finished:
            return
        if prompt_logprobs is not None:
            self.prompt_logprobs = list(prompt_logprobs)
        sample.add(text, token_ids, logprobs, None if error is not None else finish_reason, metrics)
        self.pending[index] = None
        if error is not None:
            self.error = error
            self.finished = True
        elif finish_reason is not None:
            self.num_open -= 1
            self.finished = self.num_open == 0

    def add_chunk(self, chunk: StreamOutput) -> None:
        self.add(
            chunk.text,
            chunk.token_ids,
            chunk.logprobs,
            chunk.finish_reason,
            chunk.metrics,
            None,
            chunk.index,
            chunk.prompt_logprobs,
        )

    def take_chunk(self, request_id: str) -> StreamOutput | None:
        pending = self.pending
        while pending:
            index = next(iter(pending))
            del pending[index]
            chunk = self.samples[index].take_chunk(request_id, index)
            if chunk is not None:
                self.complete = not pending and self.num_open == 0
                if self.prompt_logprobs is not None:
                    chunk = replace(chunk, prompt_logprobs=tuple(self.prompt_logprobs))
                    self.prompt_logprobs = None
                return chunk
        return None

    def is_last(self, chunk: StreamOutput) -> bool:
        return self.complete

    def result(self, request_id: str, prompt_token_ids: list[int]) -> RequestOutput:
        if self.error is not None:
            raise request_error(self.error)
        outputs = [sample.completion(i) for i, sample in enumerate(self.samples)]
        metrics = merge_metrics([o.metrics for o in outputs])
        return _request_output(request_id, prompt_token_ids, outputs, metrics, self.prompt_logprobs)


def new_accumulator(n: int) -> OutputAccumulator | SamplesAccumulator:
    """The accumulator for a request of `n` samples."""
    return OutputAccumulator() if n == 1 else SamplesAccumulator(n)


def _request_output(
    request_id: str,
    prompt_token_ids: list[int],
    outputs: list[CompletionOutput],
    metrics: RequestMetrics | None,
    prompt_logprobs: PromptLogprobs | None,
) -> RequestOutput:
    first = outputs[0]
    return RequestOutput(
        request_id,
        prompt_token_ids,
        first.text,
        first.token_ids,
        first.finish_reason,
        metrics,
        first.logprobs,
        outputs,
        prompt_logprobs,
    )


def merge_metrics(samples: Sequence[RequestMetrics | None]) -> RequestMetrics | None:
    """A request's metrics from its samples': the first token of any, the end of the last, every token."""
    known = [m for m in samples if m is not None]
    if not known:
        return None
    ttfts = [m.time_to_first_token for m in known if m.time_to_first_token is not None]
    ends = [m.e2e_latency for m in known if m.e2e_latency is not None]
    return RequestMetrics(
        time_to_first_token=min(ttfts, default=None),
        e2e_latency=max(ends, default=None),
        num_prompt_tokens=known[0].num_prompt_tokens,
        num_generated_tokens=sum(m.num_generated_tokens for m in known),
        num_cached_tokens=min(m.num_cached_tokens for m in known),
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
