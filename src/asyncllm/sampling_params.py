"""`SamplingParams`: how one request is sampled and when it stops.

Validated at construction: every bad value raises `InvalidRequestError` (a `ValueError`) that names the
field, the value and what is allowed. Real values are checked as the device computes them (float32), so
no request can carry an overflow into the step thread. Plain Python; no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.input_limits import check_json_text, check_logit_bias, check_nested, check_unicode
from asyncllm.structured import MAX_CONSTRAINT_CHARS, StructuredKind, StructuredOutput
from asyncllm.validation import check_bool, check_float, check_int, check_optional_int, is_int, short_repr

_MAX_LOGPROBS = 20
# Stop strings are matched against every new piece of text: their number and length bound the per-token cost
# one request adds to the step every request shares (20,000 of them slowed a whole batch 2.4-3.6x).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024  # masked per step while min_tokens is not reached: the same shared cost
# Samples of one request (`n`): each is a sequence of its own in every step, so one request could otherwise
# fill the batch on its own; OpenAI's limit too.
MAX_SAMPLES = 128
# Greedy below this temperature: logits / temperature would overflow float32, and the distribution is already
# its limit, the argmax (vLLM draws the same line). `SamplingParams.greedy` is the one test of greediness.
GREEDY_TEMPERATURE = 1e-5


def _fail(name: str, value: object, allowed: str) -> InvalidRequestError:
    # Cut short: an error must not echo 20,000 stop strings back.
    return InvalidRequestError(f"SamplingParams.{name}={short_repr(value)} is invalid: {allowed}")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, named and defaulted as in vLLM.

    `temperature=0` is greedy (so is any below 1e-5); `top_k` 0 or -1 disables top-k; `max_tokens=None` runs
    to a stop or to `max_model_len`; a fixed `seed` makes this request reproducible whatever else shares the batch.

    Ranges (ints are accepted for real fields; each real is checked after rounding to float32, so it must
    be finite there, at most ~3.4e38): `temperature` >= 0; `top_p` in (0, 1]; `min_p` in [0, 1];
    `repetition_penalty` in [0.01, 100] (beyond it a seen token is certain or impossible and the logits
    overflow); `presence_penalty` and `frequency_penalty` in [-2, 2]. At most `MAX_STOP_STRINGS` stop
    strings of at most `MAX_STOP_STRING_CHARS` characters each, and `MAX_STOP_TOKEN_IDS` stop token ids.

    `n` samples of the prompt (1 to `MAX_SAMPLES`): the prompt is prefilled once and its KV shared; each
    sample has its own stop and length, and with `seed=s` sample i draws as a request with `seed=s + i`
    would (without a seed the samples differ, each from a seed of its own).

    Structured output, at most one of: `json_schema` (a dict, a JSON string, or a pydantic model class, kept
    as its schema dict so the request can cross a process), `regex`, `choice` (a non-empty list of strings),
    `grammar` (EBNF/GBNF text with a `root` rule), `json_object=True` (any JSON object). Every finished
    output satisfies it; whether it compiles is checked when the request is made (`InvalidRequestError`).

    `logprobs=k` (0 to 20): each generated token's logprob and the k most likely alternatives.
    `prompt_logprobs=k` (0 to 20): the same for every prompt token after the first, scored as the model reads
    the prompt (`RequestOutput.prompt_logprobs`; 0: only the prompt token's own). Such a request takes no
    prefix-cache hit: it computes its whole prompt. `max_tokens` is at least 1: to score a prompt alone, ask
    `max_tokens=1` and leave the token (what the server does for `echo` with `max_tokens=0`).

    `logit_bias` ({token id: bias}, OpenAI's): each bias in [-100, 100] added to its token's logit before any
    other feature (at most 300 tokens); ids beyond the model's logits change nothing.
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
    n: int = 1
    json_schema: dict[str, Any] | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # Normalised forms, derived once so hot paths never re-check types.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, compare=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)
    structured: StructuredOutput | None = field(init=False, repr=False, compare=False)
    bias_items: tuple[tuple[int, float], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        number = self._number
        number("temperature", lo=0.0, allowed="a number >= 0 (0 is greedy), finite in float32 (<= 3.4e38)")
        number("top_p", lo=0.0, lo_open=True, hi=1.0, allowed="a number in (0, 1], non-zero in float32")
        check_int(_fail, "top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable", lo=-1)
        number("min_p", lo=0.0, hi=1.0, allowed="a number in [0, 1]")
        allowed = "an integer >= 1, or None (to score a prompt alone: max_tokens=1 with prompt_logprobs)"
        check_optional_int(_fail, "max_tokens", self.max_tokens, allowed, lo=1)
        check_int(_fail, "min_tokens", self.min_tokens, "an integer >= 0", lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        object.__setattr__(self, "stop_strings", self._normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_set", self._normalise_stop_ids(self.stop_token_ids))
        check_bool(_fail, "include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool(_fail, "ignore_eos", self.ignore_eos)
        check_optional_int(_fail, "seed", self.seed, "an integer, or None")
        number("repetition_penalty", lo=0.01, hi=100.0, allowed="a number in [0.01, 100] (1 disables it)")
        number("presence_penalty", lo=-2.0, hi=2.0, allowed="a number in [-2, 2]")
        number("frequency_penalty", lo=-2.0, hi=2.0, allowed="a number in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):  # alternatives per token (0: the token's own logprob only)
            value, allowed = getattr(self, name), f"an integer in [0, {_MAX_LOGPROBS}], or None"
            check_optional_int(_fail, name, value, allowed, lo=0)
            if value is not None and value > _MAX_LOGPROBS:
                raise _fail(name, value, allowed)
        allowed = f"an integer in [1, {MAX_SAMPLES}]: how many samples of the prompt"
        check_int(_fail, "n", self.n, allowed, lo=1)
        if self.n > MAX_SAMPLES:
            raise _fail("n", self.n, allowed)
        object.__setattr__(self, "structured", self._normalise_structured())
        bias = {} if self.logit_bias is None else check_logit_bias("SamplingParams.logit_bias", self.logit_bias)
        object.__setattr__(self, "bias_items", tuple(bias.items()))

    def _normalise_structured(self) -> StructuredOutput | None:
        check_bool(_fail, "json_object", self.json_object)
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) > 1:
            raise _fail(given[1], getattr(self, given[1]), f"at most one structured-output field (also {given[0]})")
        if not given:
            return None
        name = given[0]
        if name == "json_object":
            return StructuredOutput(StructuredKind.JSON_OBJECT, "")
        if name == "json_schema":
            text = self._schema_text()
        elif name == "choice":
            choices = self.choice
            if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
                raise _fail("choice", choices, "a non-empty list of strings")
            text = json.dumps(list(choices), ensure_ascii=False)
        else:
            text = getattr(self, name)
            if not isinstance(text, str) or not text.strip():
                raise _fail(name, text, "a non-empty string")
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise _fail(name, text, f"at most {MAX_CONSTRAINT_CHARS} characters (got {len(text)})")
        check_unicode(f"SamplingParams.{name}", text)
        return StructuredOutput(StructuredKind(name), text)

    def _schema_text(self) -> str:
        """The schema as JSON text; a pydantic model class is replaced by its schema dict (picklable)."""
        schema = self.json_schema
        to_schema = getattr(schema, "model_json_schema", None)
        if isinstance(schema, type) and callable(to_schema):
            schema = to_schema()
            object.__setattr__(self, "json_schema", schema)
        allowed = "a JSON schema: a dict, a JSON object as a string, or a pydantic model class"
        if isinstance(schema, str):
            try:
                schema = check_json_text("SamplingParams.json_schema", schema, max_chars=MAX_CONSTRAINT_CHARS)
            except InvalidRequestError:
                raise
            except ValueError as e:
                raise _fail("json_schema", self.json_schema, f"{allowed} (not valid JSON: {e})") from None
        if not isinstance(schema, dict):
            raise _fail("json_schema", self.json_schema, allowed)
        check_nested("SamplingParams.json_schema", schema, max_chars=MAX_CONSTRAINT_CHARS)  # before json.dumps recurses
        try:
            return json.dumps(schema, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise _fail("json_schema", self.json_schema, f"{allowed} (not serialisable as JSON: {e})") from None

    def __getstate__(self) -> dict[str, Any]:
        """What crosses a process: a schema given as a dict goes as its JSON text (`structured.text`, made and
        checked already; the same field in another of its forms), not as the dict again. A 20,000-string enum
        took ~1 ms to pickle and ~0.7 ms to load as a dict, ~0.08 ms as text, per request and per crossing."""
        state = dict(self.__dict__)
        if isinstance(state.get("json_schema"), dict) and self.structured is not None:
            state["json_schema"] = self.structured.text
        return state

    def _number(self, name: str, *, allowed: str, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
        """Validate a real-valued field and store it as a finite float (the device casts it to float32)."""
        given = getattr(self, name)
        if type(given) is float and given == _FLOAT_DEFAULTS[name]:
            return  # the default, valid by construction: most requests leave most of these as they are
        value = check_float(_fail, name, given, allowed, lo=lo, hi=hi, lo_open=lo_open, float32=True)
        object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Drawn by argmax: temperature 0, or any below `GREEDY_TEMPERATURE`."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @staticmethod
    def _normalise_stop(stop: str | list[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise _fail("stop", stop, "a string, a list of strings, or None")
        if any(s == "" for s in items):
            raise _fail("stop", stop, "stop strings must be non-empty")
        if len(items) > MAX_STOP_STRINGS:
            raise _fail("stop", stop, f"at most {MAX_STOP_STRINGS} stop strings (got {len(items)})")
        longest = max((len(s) for s in items), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            allowed = f"stop strings of at most {MAX_STOP_STRING_CHARS} characters (one has {longest})"
            raise _fail("stop", stop, allowed)
        return tuple(items)

    @staticmethod
    def _normalise_stop_ids(ids: list[int] | None) -> frozenset[int]:
        if ids is None:
            return frozenset()
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(is_int(i) and i >= 0 for i in ids):
            raise _fail("stop_token_ids", ids, "a list of non-negative integer token ids, or None")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise _fail("stop_token_ids", ids, f"at most {MAX_STOP_TOKEN_IDS} ids (got {len(ids)})")
        return frozenset(ids)


# Each real-valued field's default (`_number` skips checking a value equal to it).
_FLOAT_DEFAULTS = {f.name: f.default for f in fields(SamplingParams) if type(f.default) is float}
