"""Structured output over HTTP: `response_format` (json_object, json_schema, text), the `regex`, `choice` and
`grammar` extras, the openai client's `chat.completions.parse` into a pydantic model, and a constraint that
does not compile answered with a 400 naming its field."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import MODEL

MESSAGES: list[Any] = [{"role": "user", "content": "Describe a city."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"enum": ["small", "big"]}},
    "required": ["name", "size"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    size: int = pydantic.Field(ge=0, le=99)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        **{"model": MODEL, "messages": MESSAGES, "max_tokens": 120, "seed": 3, **kwargs}
    )


def test_json_schema_response_format_always_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = _chat(client, response_format=fmt, n=3)
    finished = [c for c in r.choices if c.finish_reason == "stop"]
    assert finished, "a tiny random model closes a 2-field object well within 120 tokens"
    for choice in finished:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_text_response_formats(client: openai.OpenAI) -> None:
    r = _chat(client, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    plain = _chat(client, response_format={"type": "text"}, temperature=0, max_tokens=8)
    assert plain.choices[0].message.content == _chat(client, temperature=0, max_tokens=8).choices[0].message.content


def test_extras_regex_and_choice_streamed_and_not(client: openai.OpenAI) -> None:
    r = _chat(client, extra_body={"regex": "[a-c]{2,5}"})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch("[a-c]{2,5}", r.choices[0].message.content)
    chunks = list(_chat(client, extra_body={"choice": ["Paris", "Lyon"]}, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in {"Paris", "Lyon"}
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=20, extra_body={"grammar": 'root ::= "ok"'})
    assert done.choices[0].text == "ok"


def test_openai_parse_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=120, seed=1, response_format=City)
    message = r.choices[0].message
    if r.choices[0].finish_reason == "stop":
        assert isinstance(message.parsed, City) and len(message.parsed.name) <= 12


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"regex": "a(b"}}, "regex"),
        ({"extra_body": {"grammar": "root ::= "}}, "grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objct"}}}}, None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, None),
        ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}}, None),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(client: openai.OpenAI, kwargs: dict[str, Any], param: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **kwargs)
    if param is not None:
        assert info.value.param == param
    after = _chat(client, max_tokens=4)  # the engine carries on
    assert after.choices[0].finish_reason == "length"
