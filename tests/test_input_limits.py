"""Bounds on client input (issue 39): every check refuses with an `InvalidRequestError` naming the field and
the bound, walks nested values without recursing (a 100,000-deep value is refused, not a RecursionError),
and stops at the bound whatever was sent."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.input_limits import (
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS,
    MAX_TOOLS,
    check_json_text,
    check_logit_bias,
    check_nested,
    check_tools_size,
    check_unicode,
    text_char_limit,
)
from asyncllm.structured import MAX_CONSTRAINT_CHARS
from asyncllm.validation import short_repr


def nested(depth: int, leaf: Any = 1) -> Any:
    """`depth` containers, dicts and lists in turn, around `leaf` (built without recursion)."""
    value = leaf
    for i in range(depth):
        value = {"k": value} if (depth - i) % 2 else [value]  # the outermost is a dict
    return value


def deep_schema(depth: int) -> dict[str, Any]:
    """An object schema `depth` objects deep (each adds two JSON levels: the object and its properties)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_depth_is_bounded_exactly() -> None:
    check_nested("x", nested(MAX_JSON_DEPTH))
    with pytest.raises(InvalidRequestError, match=rf"x\[.*nests deeper than {MAX_JSON_DEPTH} levels"):
        check_nested("x", nested(MAX_JSON_DEPTH + 1))


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_depth_past_the_interpreter_recursion_limit_is_refused_not_a_recursion_error(depth: int) -> None:
    with pytest.raises(InvalidRequestError, match="nests deeper than"):
        check_nested("x", nested(depth))


def test_a_value_holding_itself_is_refused_by_depth() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(InvalidRequestError, match="nests deeper"):
        check_nested("x", loop)


def test_size_counts_strings_and_items_and_stops_at_the_bound() -> None:
    assert check_nested("x", {"ab": ["cde", 1, None]}) == 1 + 1 + 2 + 3 + 3  # the value, items, characters
    with pytest.raises(InvalidRequestError, match=r"x is too large: more than 10 characters \(why\)"):
        check_nested("x", ["a" * 11], max_chars=10, over="why")
    wide = list(range(10_000_000))  # far more items than the bound: the walk stops after ~1,000
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="too large"):
        check_nested("x", [wide], max_chars=1_000)
    assert time.perf_counter() - start < 0.5


def test_a_huge_string_is_refused_by_size_before_its_characters_are_read() -> None:
    huge = "\ud800" * 5_000_000  # invalid too: the size, checked first, is what the error names
    with pytest.raises(InvalidRequestError, match="too large"):
        check_nested("messages", [{"content": huge}], max_chars=1_000)


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ([{"role": "user", "content": "a\ud800b"}], r"x\[0\]\['content'\] is not valid Unicode text"),
        ({"k\udc00": 1}, r"a key of x is not valid Unicode text"),
        ("\udfff", r"x is not valid Unicode text"),
    ],
)
def test_lone_surrogates_are_named_where_they_are(value: Any, where: str) -> None:
    with pytest.raises(InvalidRequestError, match=where):
        check_nested("x", value)


def test_flat_lists_are_read_whole_and_alike() -> None:
    """A list of strings or of scalars is read at C speed (an enum of 20,000 strings walked item by item held
    the event loop 10 ms a request): the same size, the same refusals, the same places named."""
    enum = [f"{i:05d}" for i in range(20_000)]
    assert check_nested("x", {"enum": enum}) == 1 + 1 + 4 + 20_000 + 5 * 20_000
    assert check_nested("x", [1, 2.5, None, True]) == 1 + 4
    with pytest.raises(InvalidRequestError, match=r"x\[2\] is not valid Unicode text"):
        check_nested("x", ["a", "b", "c\udc00"])
    with pytest.raises(InvalidRequestError, match="too large"):
        check_nested("x", enum, max_chars=50_000)


def test_valid_unicode_passes_and_surrogate_pairs_are_not_lone() -> None:
    check_unicode("t", "plain ascii")
    check_unicode("t", "café 😀 漢字")
    check_nested("x", {"é": ["😀", "漢字"]})
    with pytest.raises(InvalidRequestError, match=r"t is not valid Unicode text: surrogates not allowed '\\ud83d'"):
        check_unicode("t", "x\ud83d")  # half an emoji's surrogate pair


def test_json_text_bounds_length_then_nesting() -> None:
    assert check_json_text("s", '{"a": [1]}', max_chars=100) == {"a": [1]}
    with pytest.raises(InvalidRequestError, match="s is too large: 101 characters, more than 100"):
        check_json_text("s", " " * 101, max_chars=100)
    with pytest.raises(InvalidRequestError, match="s nests deeper than"):
        check_json_text("s", "[" * 5_000 + "]" * 5_000, max_chars=MAX_CONSTRAINT_CHARS)  # json.loads recurses
    with pytest.raises(InvalidRequestError, match=r"s\[.k.\]\[0\].*\.\.\.\(58 more\) nests deeper than 64 levels"):
        check_json_text("s", json.dumps(nested(MAX_JSON_DEPTH + 1)), max_chars=MAX_CONSTRAINT_CHARS)
    with pytest.raises(ValueError, match="Expecting property name"):  # not JSON: the caller words it
        check_json_text("s", "{", max_chars=100)


def test_tools_are_bounded_in_count_depth_and_size() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": deep_schema(3)}}
    check_tools_size([tool] * MAX_TOOLS, MAX_CONSTRAINT_CHARS)
    with pytest.raises(InvalidRequestError, match=f"more than the {MAX_TOOLS} a request may offer"):
        check_tools_size([tool] * (MAX_TOOLS + 1), MAX_CONSTRAINT_CHARS)
    deep = {"type": "function", "function": {"name": "f", "parameters": nested(MAX_JSON_DEPTH + 1)}}
    with pytest.raises(InvalidRequestError, match=r"tools\[0\]\['function'\]\['parameters'\].* nests deeper"):
        check_tools_size([deep], MAX_CONSTRAINT_CHARS)
    with pytest.raises(InvalidRequestError, match="tools is too large"):
        check_tools_size([{"description": "d" * 1_000}], 500)


def test_logit_bias_is_bounded_and_normalised() -> None:
    assert check_logit_bias("logit_bias", {"5": 1, 7: -100.0}, vocab_size=10) == {5: 1.0, 7: -100.0}
    too_many = {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}
    bad: list[tuple[Any, str]] = [
        (too_many, rf"logit_bias=<{MAX_LOGIT_BIAS + 1} entries> is invalid: at most {MAX_LOGIT_BIAS} entries"),
        ({"x": 1}, r"logit_bias=\{'x': 1\} is invalid: 'x' is not a token id"),
        ({"-1": 1}, "'-1' is not a token id"),
        ({"10": 1}, r"'10' is not a token id in \[0, 10\)"),
        ({"1": 101}, r"the bias of token 1 must be a number in \[-100, 100\], got 101"),
        ({"1": float("nan")}, "the bias of token 1 must be a number"),
        ({"1": True}, "the bias of token 1 must be a number"),
        ([1], r"logit_bias=\[1\] is invalid: a map of token ids"),
        (False, "logit_bias=False is invalid"),
    ]
    for value, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            check_logit_bias("logit_bias", value, vocab_size=10)


def test_text_char_limit() -> None:
    assert text_char_limit(512, 13) == 6656
    assert text_char_limit(512, None) is None


@pytest.mark.parametrize("as_text", [False, True])
def test_sampling_params_refuse_a_deep_schema_not_with_a_recursion_error(as_text: bool) -> None:
    """Regression (issue 39, finding 4): SamplingParams(json_schema=<900-deep object>) raised RecursionError."""
    for depth in (900, 100_000):
        schema = nested(depth)
        given = "[" * depth + "]" * depth if as_text else schema
        with pytest.raises(InvalidRequestError, match=r"SamplingParams\.json_schema.*nests deeper than 64 levels"):
            SamplingParams(json_schema=given)


def test_sampling_params_keep_schemas_within_the_bounds() -> None:
    schema = deep_schema(MAX_JSON_DEPTH // 2 - 1)
    assert SamplingParams(json_schema=schema).structured is not None
    assert SamplingParams(json_schema=json.dumps(schema)).structured is not None
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.json_schema is too large"):
        SamplingParams(json_schema={"enum": ["x" * MAX_CONSTRAINT_CHARS]})
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        SamplingParams(json_schema="{")


@pytest.mark.parametrize("field", ["regex", "grammar"])
def test_sampling_params_refuse_surrogates_in_a_constraint_before_compiling(field: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field} is not valid Unicode"):
        SamplingParams(**{field: "a\ud800"})
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.choice is not valid Unicode"):
        SamplingParams(choice=["a\ud800"])


def test_short_repr_of_a_value_too_deep_to_repr() -> None:
    assert short_repr(nested(100_000)) == "<dict>"
