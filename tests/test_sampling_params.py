"""SamplingParams: defaults as documented, every invalid field refused with a ValueError naming it."""

from __future__ import annotations

import math

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from asyncllm.validation import short_repr


def test_defaults_match_the_api() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (None, 0, None, None)
    assert (p.include_stop_str_in_output, p.ignore_eos, p.seed, p.logprobs) == (False, False, None, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop_strings == () and p.stop_token_set == frozenset()
    assert not p.greedy and not p.has_penalties


def test_normalised_forms() -> None:
    assert SamplingParams(stop="###").stop_strings == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 3, 5]).stop_token_set == frozenset({3, 5})
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "0.7"),
        ("temperature", None),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -1.0),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 3.0),
        ("min_tokens", -1),
        ("min_tokens", 1.5),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", 5),
        ("stop", ["ok", 5]),
        ("stop", b"x"),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 5),
        ("include_stop_str_in_output", 1),
        ("ignore_eos", "yes"),
        ("seed", 1.5),
        ("seed", "42"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", math.inf),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 2.0),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", 2.0),
        ("prompt_logprobs", True),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, InvalidRequestError)


def test_min_tokens_over_max_tokens() -> None:
    with pytest.raises(InvalidRequestError, match=r"min_tokens=6 .*at most max_tokens \(5\)"):
        SamplingParams(min_tokens=6, max_tokens=5)
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0, top_k=-1, top_p=1.0),
        dict(temperature=2, top_k=1, top_p=0.01, min_p=1.0),
        dict(max_tokens=1, min_tokens=0, stop=[], stop_token_ids=[]),
        dict(seed=-3, logprobs=0, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5),
        dict(stop=("a", "b"), stop_token_ids=(1, 2)),
        dict(repetition_penalty=0.01),  # the documented bound, though 0.01 rounds below itself in float32
        dict(repetition_penalty=100.0, top_p=0.1),
    ],
)
def test_valid_edges_are_accepted(kwargs: dict) -> None:
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(p, key) == value


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 10**400),
        ("temperature", 1e39),
        ("temperature", 4e38),
        ("top_p", 1e-300),
        ("min_p", 10**400),
        ("repetition_penalty", 1e300),
        ("repetition_penalty", 10**400),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1000.0),
        ("repetition_penalty", 0.001),
        ("presence_penalty", -(10**400)),
        ("frequency_penalty", 10**5000),
        ("max_tokens", -(10**5000)),
    ],
    ids=lambda v: short_repr(v, limit=30),
)
def test_values_that_overflow_float32_are_refused_at_construction(field: str, value: object) -> None:
    """Regression (issue 10, defect 1): numbers finite in Python (huge ints, float64s beyond float32, values
    that round to 0 in float32) passed validation and overflowed in the step thread's float32 cast, killing
    the engine for every stream. Refused now, naming the field; a 5,000-digit int does not break the message."""
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_float32_limits_themselves_are_accepted() -> None:
    p = SamplingParams(temperature=3.4e38, top_p=1e-30, repetition_penalty=100, presence_penalty=-2)
    assert p.temperature == 3.4e38 and p.top_p == 1e-30 and p.repetition_penalty == 100.0
    assert isinstance(p.repetition_penalty, float) and isinstance(p.presence_penalty, float)


def test_stop_strings_are_bounded_in_number_and_length() -> None:
    """Regression (issue 10, also seen): one request with 20,000 stop strings slowed every request sharing
    its steps 2.4-3.6x (stop matching runs per token). Their number and length are bounded, and the error
    does not echo the whole list back."""
    assert len(SamplingParams(stop=["x"] * MAX_STOP_STRINGS).stop_strings) == MAX_STOP_STRINGS
    assert SamplingParams(stop="y" * MAX_STOP_STRING_CHARS).stop_strings == ("y" * MAX_STOP_STRING_CHARS,)
    with pytest.raises(InvalidRequestError, match=rf"at most {MAX_STOP_STRINGS} stop strings") as info:
        SamplingParams(stop=[f"s{i}" for i in range(20_000)])
    assert len(str(info.value)) < 300
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRING_CHARS} characters"):
        SamplingParams(stop=["ok", "z" * (MAX_STOP_STRING_CHARS + 1)])
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.stop_token_ids=.*at most {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))


# ---------------------------------------------------------------- structured output (issue 21)


def test_structured_output_fields_normalise_to_one_spec() -> None:
    from asyncllm.structured import StructuredKind

    assert SamplingParams().structured is None
    spec = SamplingParams(json_schema={"type": "object"}).structured
    assert spec is not None and spec.kind is StructuredKind.JSON_SCHEMA and spec.text == '{"type": "object"}'
    assert SamplingParams(json_schema='{"type": "integer"}').structured.text == '{"type": "integer"}'
    assert SamplingParams(choice=["yes", "no"]).structured.choices == ["yes", "no"]
    assert SamplingParams(regex=r"\d+").structured.text == r"\d+"
    assert SamplingParams(grammar='root ::= "a"').structured.kind is StructuredKind.GRAMMAR
    assert SamplingParams(json_object=True).structured.kind is StructuredKind.JSON_OBJECT


def test_a_pydantic_class_is_kept_as_its_schema_so_the_request_pickles() -> None:
    import pickle

    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int

    params = SamplingParams(json_schema=Person)
    assert params.json_schema == Person.model_json_schema()
    assert pickle.loads(pickle.dumps(params)).structured == params.structured


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"regex": "a", "grammar": "root ::= 'a'"}, "grammar"),
        ({"json_schema": {}, "json_object": True}, "json_object"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": "[1, 2]"}, "json_schema"),
        ({"json_schema": 3}, "json_schema"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 1]}, "choice"),
        ({"regex": ""}, "regex"),
        ({"grammar": "   "}, "grammar"),
        ({"json_object": "yes"}, "json_object"),
        ({"regex": "a" * 200_001}, "regex"),
    ],
)
def test_bad_structured_output_fields_are_named(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"SamplingParams.{field}="):
        SamplingParams(**kwargs)
