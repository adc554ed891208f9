"""Tool calls over HTTP with the official openai client: forced calls always parse and satisfy their tool's
schema, streamed deltas have OpenAI's exact shape and add up to the same call, the client's `parse()` fills
`parsed_arguments`, a conversation carries tool calls and results back to the template, and what cannot be
honoured is a 400 naming the request's field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from asyncllm import AsyncLLMEngine, SamplingParams
from asyncllm.chat import apply_chat_template
from asyncllm.server import create_app
from tests.fixtures.chat_templates import HERMES
from tests.fixtures.tiny_models import build_checkpoint
from tests.server.serving import RunningServer, start_server

MODEL = "tiny-tools"
# Tool schemas take many tokens of the tiny tokenizer: a checkpoint with room for them.
ENGINE_ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=512)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 8}, "limit": {"type": "integer"}},
    "required": ["query"],
}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    path = build_checkpoint(tmp_path_factory.mktemp("tools") / "qwen3", "qwen3", max_position_embeddings=2048)
    engine = AsyncLLMEngine(str(path), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hermes_server(tools_engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(tools_engine, served_model_name=MODEL, chat_template=HERMES))
    yield running
    running.stop()


@pytest.fixture
def tools_client(hermes_server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=hermes_server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 300, **kwargs}
    return client.chat.completions.create(**args)


def _check_call(call: Any, names: set[str]) -> None:
    assert call.type == "function" and call.function.name in names
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.needs_structured_output
@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [("required", set(SCHEMAS)), ({"type": "function", "function": {"name": "search"}}, {"search"})],
)
def test_a_forced_call_always_parses_and_satisfies_its_schema(
    tools_client: openai.OpenAI, tool_choice: Any, names: set[str]
) -> None:
    for seed in range(3):
        r = _chat(tools_client, tool_choice=tool_choice, parallel_tool_calls=False, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0], names)


@pytest.mark.needs_structured_output
def test_each_of_n_samples_is_parsed_on_its_own(tools_client: openai.OpenAI) -> None:
    r = _chat(tools_client, tool_choice="required", parallel_tool_calls=False, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0], set(SCHEMAS))
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 3


def _events(server: RunningServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.needs_structured_output
def test_streamed_call_deltas_have_openai_shape_and_add_up(
    tools_client: openai.OpenAI, hermes_server: RunningServer
) -> None:
    args = dict(tool_choice="required", seed=4, temperature=1.0, max_tokens=300)
    whole = _chat(tools_client, **args).choices[0].message.tool_calls
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "stream": True, **args}
    deltas = [e["choices"][0] for e in _events(hermes_server, body)]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert deltas[-1]["delta"] == {} and deltas[-1]["finish_reason"] == "tool_calls"
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas[1:-1]:
        assert set(d["delta"]) == {"tool_calls"} and d["finish_reason"] is None, d  # no content around calls
        (item,) = d["delta"]["tool_calls"]
        if item["index"] not in calls:  # a call's first delta: OpenAI's exact keys, empty arguments
            assert set(item) == {"index", "id", "type", "function"} and item["type"] == "function"
            assert item["function"]["arguments"] == "" and set(item["function"]) == {"name", "arguments"}
            calls[item["index"]] = {"id": item["id"], "name": item["function"]["name"], "arguments": ""}
        else:
            assert set(item) == {"index", "function"} and set(item["function"]) == {"arguments"}
            calls[item["index"]]["arguments"] += item["function"]["arguments"]
    assert sorted(calls) == list(range(len(whole)))  # the same seed: the same calls (ids are fresh)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


@pytest.mark.needs_structured_output
def test_the_clients_stream_accumulates_the_same_call(tools_client: openai.OpenAI) -> None:
    args = dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=2, temperature=1.0)
    whole = _chat(tools_client, **args).choices[0].message.tool_calls
    with tools_client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300, **args) as s:
        final = s.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (whole[0].function.name, whole[0].function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    unit: Literal["c", "f"]


@pytest.mark.needs_structured_output
def test_openai_parse_fills_parsed_arguments(tools_client: openai.OpenAI) -> None:
    r = tools_client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        seed=1,
    )
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather) and call.function.name == "Weather"


def test_a_conversation_carries_calls_and_results_back(
    tools_client: openai.OpenAI, tools_engine: AsyncLLMEngine
) -> None:
    """The assistant's calls (content null, arguments as JSON text) and the tool's answer reach the template
    as engine.chat gives them to it: the prompt counts exactly the tokens of that conversation."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    r = _chat(tools_client, messages=history, max_tokens=4, temperature=0)
    want = apply_chat_template(tools_engine.tokenizer, history, tools=TOOLS, chat_template=HERMES, tokenize=True)
    assert r.usage is not None and r.usage.prompt_tokens == len(want)
    text = apply_chat_template(tools_engine.tokenizer, history, tools=TOOLS, chat_template=HERMES)
    assert '"arguments": {"city": "Paris"}' in text and "<tool_response>" in text


@pytest.mark.needs_structured_output
def test_a_reply_sent_back_as_the_client_returned_it(tools_client: openai.OpenAI) -> None:
    """OpenAI's own loop: append the reply object (as `parse()` returned it), then the tool's result."""
    r = tools_client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(Weather)], tool_choice="required", seed=3
    )
    message = r.choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls or []]
    again = tools_client.chat.completions.create(
        model=MODEL, messages=[*ASK, message, *results], tools=[openai.pydantic_function_tool(Weather)], max_tokens=3
    )
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_lists_the_tools_and_reads_no_call(tools_client: openai.OpenAI) -> None:
    plain = _chat(tools_client, tools=None, max_tokens=2)
    lookalike = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    r = _chat(tools_client, tool_choice="none", extra_body={"choice": [lookalike]})
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and message.content == lookalike and not message.tool_calls


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"properties": {"a": {"type": "string", "pattern": "(("}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_object"}}, "response_format"),  # auto calls are constrained too
        ({"tool_choice": "required", "extra_body": {"regex": "a+"}}, "regex"),
        ({"extra_body": {"ignore_eos": True}}, "ignore_eos"),
        ({"parallel_tool_calls": "often"}, "parallel_tool_calls"),
        ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    tools_client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(tools_client, **kwargs)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert "SamplingParams" not in body["message"] and "params." not in body["message"], body


def test_a_model_without_a_call_format_refuses_tools_naming_them(client: openai.OpenAI) -> None:
    """The session server keeps the tiny model's own template (ChatML, no tool-call format)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=2)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "tools"
    # Not callable, the tools change nothing here (this template does not list them), and the reply is the
    # caller's to constrain.
    fmt = {"type": "json_object"}
    args: dict[str, Any] = dict(model="tiny", messages=ASK, max_tokens=8, temperature=0, response_format=fmt)
    r = client.chat.completions.create(**args, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == client.chat.completions.create(**args).choices[0].message.content


@pytest.mark.needs_structured_output
def test_a_forced_call_cut_off_by_max_tokens_is_a_call_not_markup(
    tools_client: openai.OpenAI, hermes_server: RunningServer, tools_engine: AsyncLLMEngine
) -> None:
    """Regression: a named call cut off by the token limit came back as raw `<tool_call>` markup in `content`
    with no tool calls. Now: the call as far as it got (its name, its arguments' JSON so far), finish reason
    "length", as vLLM answers; streamed the same, and the same through `engine.chat`."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    args = dict(tool_choice=named, max_tokens=50, seed=2)  # the tiny tokenizer's 50: into the arguments
    choice = _chat(tools_client, **args).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "stream": True, **args}
    deltas = [e["choices"][0] for e in _events(hermes_server, body)]
    assert deltas[-1]["finish_reason"] == "length"
    assert not "".join(d["delta"].get("content") or "" for d in deltas)
    first, *rest = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert (first["function"]["name"], first["id"].startswith("call_")) == ("get_weather", True)
    assert "".join(t["function"]["arguments"] for t in rest) == call.function.arguments

    async def chat() -> list[Any]:
        params = SamplingParams(max_tokens=50, seed=2)
        return [c async for c in tools_engine.chat(ASK, params, tools=TOOLS, tool_choice=named, chat_template=HERMES)]

    chunks = asyncio.run(chat())
    assert chunks[-1].finish_reason == "length" and not "".join(c.text for c in chunks)
    assert [c.name for chunk in chunks for c in chunk.tool_calls] == ["get_weather"]
