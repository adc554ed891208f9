"""What OpenAI clients and frameworks send: null for any optional field, and fields whose value changes
nothing here, are accepted; a value the server cannot honour is a 400 naming the field. OpenAI's silent
rules hold too: /v1/completions stops at 16 tokens by default, `developer` is the system role, unknown roles
are refused, temperature is within [0, 2], and errors name fields as the request does."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.serving import RunningServer

MESSAGES: list[Any] = [{"role": "user", "content": "Hi"}]
# Every optional chat field OpenAI's API reference lists, as null.
NULLS = [
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "metadata", "modalities", "moderation", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
]  # fmt: skip
# Values that change nothing here.
NEUTRAL: dict[str, Any] = {
    "logit_bias": {},
    "store": False,
    "service_tier": "auto",
    "verbosity": "medium",
    "modalities": ["text"],
    "response_format": {"type": "text"},
    "parallel_tool_calls": True,
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "metadata": {"team": "search"},
    "user": "u-1",
    "safety_identifier": "hash",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "Hello"},
}


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, timeout=60)


def test_null_in_every_optional_field_is_the_default(server: RunningServer) -> None:
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    r = _post(server, "chat/completions", {**base, **dict.fromkeys(NULLS), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == _post(server, "chat/completions", base).json()["choices"][0]["message"]
    message = {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None, "annotations": None}
    history = [*MESSAGES, {**message, "name": None, "audio": None, "function_call": None}, *MESSAGES]
    assert _post(server, "chat/completions", {**base, "messages": history}).status_code == 200
    nulls = dict.fromkeys(["echo", "suffix", "best_of", "logit_bias", "logprobs", "n", "stream", "user", "stop"])
    done = _post(server, "completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **nulls})
    assert done.status_code == 200, done.text


@pytest.mark.parametrize(("field", "value"), sorted(NEUTRAL.items()))
def test_a_value_that_changes_nothing_is_accepted(server: RunningServer, field: str, value: Any) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value}
    r = _post(server, "chat/completions", body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"42": -101}),  # OpenAI's range is [-100, 100]
        ("logit_bias", {"-3": 1}),  # not a token id
        ("store", True),
        ("service_tier", "flex"),
        ("reasoning_effort", "low"),
        ("verbosity", "high"),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("web_search_options", {}),
        ("moderation", {"model": "omni-moderation-latest"}),
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("temperature", 2.5),
        ("temperature", -0.5),
    ],
)
def test_a_value_that_cannot_be_honoured_is_a_400_naming_it(server: RunningServer, field: str, value: Any) -> None:
    r = _post(server, "chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"logit_bias": {"one": 5}}, "logit_bias"), ({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of")],
)
def test_completion_values_that_cannot_be_honoured(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, suffix="", best_of=2, n=2)
    assert len(ok.choices) == 2


def test_completions_stop_at_16_tokens_by_default(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Once", extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_developer_is_the_system_role(client: openai.OpenAI) -> None:
    def reply(role: str) -> Any:
        messages: Any = [{"role": role, "content": "Be brief."}, *MESSAGES]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)

    developer, system = reply("developer"), reply("system")
    assert developer.usage is not None and system.usage is not None
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens  # (the second is a prefix-cache hit)
    assert developer.usage.completion_tokens == system.usage.completion_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(max_completion_tokens=0), "max_completion_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objct"}}}),
         "response_format"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_errors_name_fields_as_the_request_does(
    client: openai.OpenAI, kwargs: dict[str, Any], name: str, stream: bool
) -> None:
    """Even a constraint that fails to compile once the request is under way: a 400 before any event."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream, **kwargs)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == name and name in body["message"], body
    assert "SamplingParams" not in body["message"]
