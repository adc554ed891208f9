"""Every malformed body is the client's fault (issue 39): the catalogue below (lone surrogates, nesting past
any bound, a wrong type in each field, oversized messages, tools and schemas, bad stop strings and logit_bias)
goes to both generation endpoints, and each answer is a 4xx in OpenAI's shape naming the field at fault, never
a 500; a body past the server's byte bound is a 413, unread. The server still serves afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pydantic
import pytest

from asyncllm.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.conftest import MODEL
from tests.server.serving import RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 2},
}
MODELS: dict[str, type[pydantic.BaseModel]] = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest}
TOOL: dict[str, Any] = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def post(server: RunningServer, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: "\ud800" as an escape
    return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)


def assert_client_error(response: httpx.Response, field: str | None) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
    if field is not None:
        named = f"{error['param']} {error['message']}"
        assert field in named, (field, error)
    return error


def raw_with(path: str, key: str, json_value: bytes) -> bytes:
    """The endpoint's base body with `key` set to the raw JSON text `json_value` (escapes kept as sent)."""
    return json.dumps({**BASE[path], key: "@value@"}).encode().replace(b'"@value@"', json_value)


SURROGATE_CASES = [  # (path, key, raw JSON value, field named)
    (CHAT, "messages", b'[{"role": "user", "content": "a\\ud800b"}]', "messages[0]"),
    (CHAT, "messages", b'[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]', "messages[0]"),
    (CHAT, "messages", b'[{"role": "user", "content": "hi", "name": "\\ud83d"}]', "messages[0]"),
    (CHAT, "tools", b'[{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]', "tools[0]"),
    (CHAT, "response_format", b'{"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["\\ud800"]}}}',
     "response_format"),
    (CHAT, "user", b'"\\udc00"', "user"),
    (COMPLETIONS, "prompt", b'"a\\ud800b"', "prompt"),
    (COMPLETIONS, "prompt", b'["ok", "\\ud800"]', "prompt[1]"),
    (COMPLETIONS, "regex", b'"a\\ud800"', "regex"),
    (COMPLETIONS, "stop", b'["\\ud800"]', "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "key", "value", "field"), SURROGATE_CASES)
def test_lone_surrogates_are_a_400_naming_the_field(
    server: RunningServer, path: str, key: str, value: bytes, field: str
) -> None:
    """Regression (issue 39, finding 3): a lone surrogate in a chat message was a 500."""
    assert_client_error(post(server, path, raw_with(path, key, value)), field)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_surrogate_in_a_field_name_and_raw_cesu8_bytes_are_400s(server: RunningServer, path: str) -> None:
    surrogate_name = json.dumps(BASE[path]).encode()[:-1] + b', "x\\udc00": 1}'
    error = assert_client_error(post(server, path, surrogate_name), None)
    assert "field's name" in error["message"]
    cesu8 = json.dumps(BASE[path]).encode().replace(b'"hi"', b'"a\xed\xa0\x80b"')  # a surrogate as UTF-8 bytes
    assert_client_error(post(server, path, cesu8), None)


DEEP = "@deep@"  # where a case's nested value goes (written out by hand: json.dumps recurses)
# (path, key, value, depth at DEEP, field named): past json.loads' recursion, past the body's bound, past a schema's.
DEEP_CASES = [
    (CHAT, "messages", DEEP, 100_000, "messages"),
    (CHAT, "response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": DEEP}}, 1_000,
     "response_format"),
    (CHAT, "response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {"a": DEEP}}}, 70,
     "response_format"),
    (CHAT, "tools", [{**TOOL, "function": {"name": "f", "parameters": {"type": "object", "p": DEEP}}}], 900,
     "tools"),
    (CHAT, "tools", [{**TOOL, "function": {"name": "f", "parameters": {"type": "object", "p": DEEP}}}], 66,
     "tools[0]"),
    (CHAT, "chat_template_kwargs", {"v": DEEP}, 70, "chat_template_kwargs"),
    (CHAT, "tool_choice", DEEP, 500, "tool_choice"),
    (CHAT, "metadata", DEEP, 2_000, "metadata"),
    (COMPLETIONS, "prompt", DEEP, 5_000, "prompt"),
    (COMPLETIONS, "stop", DEEP, 90, "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "key", "value", "depth", "field"), DEEP_CASES)
def test_deep_nesting_is_a_400_naming_the_field(
    server: RunningServer, path: str, key: str, value: Any, depth: int, field: str
) -> None:
    """Regression (issue 39, finding 4): a body nested past ~1,000 levels was a 500 (json.loads' RecursionError)."""
    body = json.dumps({**BASE[path], key: value}).encode()
    assert_client_error(post(server, path, body.replace(b'"@deep@"', deep_text(depth))), field)


def deep_text(depth: int) -> bytes:
    """`depth` arrays and objects within each other, as JSON text."""
    opens = [b"[" if i % 2 else b'{"a": ' for i in range(depth)]
    closes = [b"]" if i % 2 else b"}" for i in range(depth)]
    return b"".join(opens) + b'"x"' + b"".join(reversed(closes))


def _wrong_value(annotation: Any) -> Any:
    """A JSON value `annotation` refuses (None when it accepts any)."""
    adapter = pydantic.TypeAdapter(annotation)
    for candidate in ({"wrong": [1]}, ["wrong"], 12345, "wrong", True, 1.5):
        try:
            adapter.validate_python(candidate)
        except pydantic.ValidationError:
            return candidate
    return None


def _wrong_types() -> list[tuple[str, str, Any]]:
    cases = []
    for path, model in MODELS.items():
        for name, info in model.model_fields.items():
            wrong = _wrong_value(info.annotation)
            if wrong is not None:
                cases.append((path, info.alias or name, wrong))
    return cases


@pytest.mark.parametrize(("path", "key", "value"), _wrong_types())
def test_a_wrong_type_in_any_field_is_a_400_naming_it(server: RunningServer, path: str, key: str, value: Any) -> None:
    assert_client_error(post(server, path, {**BASE[path], key: value}), key)


TOO_LARGE_CASES = [  # (path, key, value): a body past the server's byte bound (2.3 MB for the tiny model)
    (CHAT, "messages", [{"role": "user", "content": "b " * 5_000_000}]),
    (CHAT, "chat_template_kwargs", {"notes": "n" * 10_000_000}),
    (COMPLETIONS, "prompt", "p" * 10_000_000),
    (COMPLETIONS, "prompt", list(range(1, 2_000_000))),
    (COMPLETIONS, "prompt", ["p" * 6_000] * 500),  # each prompt fits: the batch does not
]


@pytest.mark.parametrize(("path", "key", "value"), TOO_LARGE_CASES)
def test_a_body_past_the_byte_bound_is_a_413_and_is_not_read(
    server: RunningServer, path: str, key: str, value: Any
) -> None:
    response = post(server, path, {**BASE[path], key: value})
    assert response.status_code == 413 and response.headers["connection"] == "close", response.text[:300]
    assert response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_chunked_body_past_the_byte_bound_is_a_413(server: RunningServer, path: str) -> None:
    """No Content-Length to refuse at once: the body is read up to the bound, then refused."""

    def pieces() -> Iterator[bytes]:
        yield json.dumps(BASE[path]).encode()[:-1] + b', "user": "'
        for _ in range(400):
            yield b"u" * 10_000
        yield b'"}'

    response = httpx.post(server.url + path, content=pieces(), headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413, response.text[:300]


OVERSIZED_CASES = [  # (path, key, value, field named): under the byte bound, over a field's
    (CHAT, "messages", [{"role": "user", "content": "b " * 100_000}], "messages"),
    (CHAT, "tools", [TOOL] * 129, "tools"),
    (CHAT, "tools", [{**TOOL, "function": {"name": "f", "description": "d" * 300_000}}], "tools"),
    (CHAT, "response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["x" * 3**12]}}},
     "response_format"),
    (CHAT, "chat_template_kwargs", {"notes": "n" * 1_000_000}, "chat_template_kwargs"),
    (COMPLETIONS, "prompt", "p" * 1_000_000, "prompt"),
    (COMPLETIONS, "prompt", list(range(1, 200_000)), "prompt"),
    (COMPLETIONS, "choice", ["c" * 1_000] * 300, "choice"),
    (COMPLETIONS, "stop", ["s"] * 65, "stop"),
    (COMPLETIONS, "stop", ["s" * 257], "stop"),
    (COMPLETIONS, "logit_bias", {str(i): 1 for i in range(301)}, "logit_bias"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "key", "value", "field"), OVERSIZED_CASES)
def test_oversized_inputs_are_a_400_naming_the_field(
    server: RunningServer, path: str, key: str, value: Any, field: str
) -> None:
    assert_client_error(post(server, path, {**BASE[path], key: value}), field)


BAD_VALUE_CASES = [  # (path, key, value, field named)
    (CHAT, "logit_bias", {"x": 1}, "logit_bias"),
    (CHAT, "logit_bias", {"5": 1000}, "logit_bias"),
    (CHAT, "stop", [""], "stop"),
    (COMPLETIONS, "stop", [1], "stop"),
    (COMPLETIONS, "logit_bias", {"-1": 1}, "logit_bias"),
    (CHAT, "messages", [], "messages"),
    (CHAT, "messages", [{"role": "robot", "content": "x"}], "messages[0]"),
    (CHAT, "tools", [{"type": "function", "function": {"name": "bad name!"}}], "tools[0]"),
    (CHAT, "tool_choice", {"type": "function", "function": {"name": "absent"}}, "tool_choice"),
    (COMPLETIONS, "max_tokens", 10**400, "max_tokens"),
    (COMPLETIONS, "n", 10**30, "n"),
    (COMPLETIONS, "prompt", [10**9], "prompt"),
]


@pytest.mark.parametrize(("path", "key", "value", "field"), BAD_VALUE_CASES)
def test_bad_values_are_a_400_naming_the_field(
    server: RunningServer, path: str, key: str, value: Any, field: str
) -> None:
    assert_client_error(post(server, path, {**BASE[path], key: value}), field)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("raw", [b"", b"null", b"[]", b"{", b'"text"', b"NaN", b'{"model": NaN}', b"\xff\xfe"])
def test_bodies_that_are_no_request_are_a_400(server: RunningServer, path: str, raw: bytes) -> None:
    assert_client_error(post(server, path, raw), None)


def test_the_server_serves_after_the_catalogue(server: RunningServer) -> None:
    for path, body in BASE.items():
        assert post(server, path, body).status_code == 200
