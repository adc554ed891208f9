"""`SamplingParams`: how one request is sampled and when it stops.

Validated at construction: every bad value raises `InvalidRequestError` (a `ValueError`) that names the
field, the value and what is allowed. Plain Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm.errors import InvalidRequestError

_MAX_LOGPROBS = 20


def _fail(name: str, value: object, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.{name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, named and defaulted as in vLLM.

    `temperature=0` is greedy; `top_k` 0 or -1 disables top-k; `max_tokens=None` runs to a stop or to
    `max_model_len`; a fixed `seed` makes this request reproducible whatever else shares the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # Normalised forms, derived once so hot paths never re-check types.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, compare=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_number("temperature", self.temperature, lo=0.0, allowed="a number >= 0 (0 is greedy)")
        self._check_number("top_p", self.top_p, lo=0.0, allowed="a number in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", self.top_p, "a number in (0, 1]")
        self._check_int("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable")
        if self.top_k < -1:
            raise _fail("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable")
        self._check_number("min_p", self.min_p, lo=0.0, allowed="a number in [0, 1]")
        if self.min_p > 1.0:
            raise _fail("min_p", self.min_p, "a number in [0, 1]")
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens, "an integer >= 1, or None")
            if self.max_tokens < 1:
                raise _fail("max_tokens", self.max_tokens, "an integer >= 1, or None")
        self._check_int("min_tokens", self.min_tokens, "an integer >= 0")
        if self.min_tokens < 0:
            raise _fail("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        object.__setattr__(self, "stop_strings", self._normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_set", self._normalise_stop_ids(self.stop_token_ids))
        for name in ("include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "True or False")
        if self.seed is not None:
            self._check_int("seed", self.seed, "an integer, or None")
        self._check_number("repetition_penalty", self.repetition_penalty, lo=0.0, allowed="a number > 0")
        if self.repetition_penalty <= 0.0:
            raise _fail("repetition_penalty", self.repetition_penalty, "a number > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check_number(name, value, lo=-2.0, allowed="a number in [-2, 2]")
            if value > 2.0:
                raise _fail(name, value, "a number in [-2, 2]")
        if self.logprobs is not None:
            self._check_int("logprobs", self.logprobs, f"an integer in [0, {_MAX_LOGPROBS}], or None")
            if not 0 <= self.logprobs <= _MAX_LOGPROBS:
                raise _fail("logprobs", self.logprobs, f"an integer in [0, {_MAX_LOGPROBS}], or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @staticmethod
    def _check_number(name: str, value: object, lo: float, allowed: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(name, value, allowed)
        if value != value or value in (float("inf"), float("-inf")) or value < lo:  # NaN, inf, too small
            raise _fail(name, value, allowed)

    @staticmethod
    def _check_int(name: str, value: object, allowed: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(name, value, allowed)

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise _fail("stop", stop, "a string, a list of strings, or None")
        if any(s == "" for s in items):
            raise _fail("stop", stop, "stop strings must be non-empty")
        return tuple(items)

    @staticmethod
    def _normalise_stop_ids(ids: list[int] | None) -> frozenset[int]:
        if ids is None:
            return frozenset()
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise _fail("stop_token_ids", ids, "a list of non-negative integer token ids, or None")
        return frozenset(ids)
