"""Turns sampled tokens into what callers see: stop decisions, text with stop-string hold-back, deltas.

Runs in the engine core (the step thread), so a stop string frees the request's blocks in the same step
and the event loops only merge finished deltas. Time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from asyncllm.core.byte_level import ByteLevelPieces
from asyncllm.core.detokenizer import IncrementalDetokenizer
from asyncllm.core.request import Request
from asyncllm.errors import AsyncLLMError
from asyncllm.outputs import FinishReason, RequestMetrics


@dataclass(slots=True)  # one per request per step: no per-instance dict
class RequestDelta:
    """What is new for one request after one step; the async layer merges these per consumer.

    `error` set means this request failed alone: the delta is final (`finish_reason` is set too, "abort",
    and the core has freed the request), and its stream hands out the text and tokens it carries, then
    raises the error (`outputs.request_error`). Every other request carries on. A str says what was wrong
    with the request, in the caller's terms (`InvalidRequestError`); an `AsyncLLMError` instance is raised
    as its own kind (`RequestFailedError`: the engine failed it, not the caller).

    For a request of n > 1 samples (`core/sample_group.py`) `request_id` is the request's and `index` the
    sample's; a sample's final delta says how many of its samples are still open (`open_samples`): the
    request's output is final at 0, or with `error` (which ends every sample).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[dict[int, float]] | None = None  # one per new token, when the request asked for them
    error: str | AsyncLLMError | None = None
    index: int = 0  # the sample (n > 1)
    open_samples: int = 0  # on a sample's final delta: samples of its request still running
    # On the request's first token's delta, when it asked for them: one per prompt token, None first.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    pooled: list[float] | None = None  # on a pooling request's final delta: its embedding or score (core/pooling.py)


class _TextState:
    __slots__ = ("detok", "emitted", "hold_back", "text")

    def __init__(self, detok: IncrementalDetokenizer | None, hold_back: int) -> None:
        self.detok = detok
        self.text = ""  # with stop strings only: the text so far, searched for them
        self.emitted = 0  # characters of `text` already handed out
        self.hold_back = hold_back


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer  # None: token ids only, no text (stop strings then unsupported)
        self._pieces = ByteLevelPieces.of(tokenizer) if tokenizer is not None else None  # shared by requests
        self._states: dict[str, _TextState] = {}

    def add_request(self, request: Request) -> None:
        detok = None
        if self._tokenizer is not None:
            detok = IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids, pieces=self._pieces)
        stops = request.params.stop_strings
        hold_back = max((len(s) for s in stops), default=1) - 1
        self._states[request.request_id] = _TextState(detok, hold_back)

    def process_token(self, request: Request, token_id: int) -> tuple[str, FinishReason | None]:
        """Account for one appended token: returns (text to emit now, finish reason or None)."""
        state = self._states[request.request_id]
        params = request.params
        reason: FinishReason | None = None
        n_out = request.num_output_tokens
        past_min = n_out >= params.min_tokens
        if past_min and (
            (token_id in request.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_set
        ):
            reason = "stop"
        new_text = state.detok.push(token_id) if state.detok is not None else ""
        if not params.stop_strings:  # nothing to search or hold back: text goes out as it comes, unkept
            text = new_text if reason is None else ""  # a stop token's own text is never emitted
            if reason is None and n_out >= request.max_tokens:
                reason = "length"
            if reason is not None and state.detok is not None:
                text += state.detok.flush()  # an incomplete character at the end renders as U+FFFD
            return text, reason
        if reason is None and new_text:
            old_len = len(state.text)
            state.text += new_text
            if past_min and params.stop_strings:
                cut = self._find_stop(state.text, old_len, params.stop_strings, params.include_stop_str_in_output)
                if cut is not None:
                    state.text = state.text[:cut]
                    reason = "stop"
        if reason is None and (n_out >= request.max_tokens):
            reason = "length"
        if reason is not None and state.detok is not None:
            state.text += state.detok.flush()  # an incomplete character at the end renders as U+FFFD
        end = len(state.text) if reason is not None else max(state.emitted, len(state.text) - state.hold_back)
        out = state.text[state.emitted : end]
        state.emitted = end
        return out, reason

    def flush(self, request_id: str) -> str:
        """Release held-back text of a request ending for another reason (e.g. abort) and forget it."""
        state = self._states.pop(request_id, None)
        if state is None:
            return ""
        tail = state.detok.flush() if state.detok is not None else ""
        return state.text[state.emitted :] + tail

    @staticmethod
    def _find_stop(text: str, old_len: int, stops: tuple[str, ...], include: bool) -> int | None:
        """Index where the text should end if a stop string ends past `old_len` (in the new text), else None.

        Each stop is searched from `old_len - len(stop) + 1`: one lying wholly in older text was either seen
        already or generated before `min_tokens`, when stops do not count (a shared start for all stops
        found such a short stop late, inside the tail held back for a longer one).
        """
        found: list[tuple[int, str]] = []
        for stop in stops:
            index = text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1:
                found.append((index, stop))
        if not found:
            return None
        index, stop = min(found)
        return index + len(stop) if include else index


def request_metrics(request: Request, now: float) -> RequestMetrics:
    ttft = None if request.first_token_time is None else request.first_token_time - request.arrival_time
    return RequestMetrics(
        time_to_first_token=ttft,
        e2e_latency=now - request.arrival_time,
        num_prompt_tokens=request.num_prompt_tokens,
        num_generated_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
    )
