"""POST /v1/responses with the official openai client's `responses.create` / `responses.stream` / `responses.parse`:
text in and out, streamed events in OpenAI's order adding up to the whole response, every field taking effect
(instructions, max_output_tokens, temperature / top_p, text.format, tools and tool_choice, function_call and
function_call_output items, reasoning items), and refusals as 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.chat import apply_chat_template
from asyncllm.server import create_app
from tests.fixtures.chat_templates import THINKING
from tests.server.serving import RunningServer, start_server
from tests.server.test_tools import SCHEMAS, TOOLS

MODEL = "tiny"
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's flat tools
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"enum": ["small", "big"]}},
    "required": ["name", "size"],
    "additionalProperties": False,
}
SIZE = {"enum": ["small", "big"]}


@pytest.fixture(scope="module")
def thinking_server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(engine, served_model_name="tiny-thinking", chat_template=THINKING))
    yield running
    running.stop()


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_text_in_text_out(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    r = client.responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and r.output_text == message.content[0].text != ""
    assert r.usage is not None and r.usage.output_tokens == 6
    # instructions are the system turn, the string input the user turn: the prompt is exactly that conversation
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    prompt = apply_chat_template(engine.tokenizer, conversation)
    assert r.usage.input_tokens == len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.total_tokens == r.usage.input_tokens + 6


def test_temperature_and_top_p_take_effect(client: openai.OpenAI) -> None:
    """temperature 0 and top_p ~0 are each the greedy reply, as chat completions gives it for the same turn."""
    ask: Any = [{"role": "user", "content": "Count"}]
    greedy = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0)
    cold = client.responses.create(model=MODEL, input=ask, max_output_tokens=8, temperature=0)
    narrow = client.responses.create(model=MODEL, input=ask, max_output_tokens=8, temperature=1.0, top_p=1e-9)
    assert cold.output_text == narrow.output_text == greedy.choices[0].message.content
    hot = {  # seeded: unseeded draws could match by chance
        client.responses.create(
            model=MODEL, input=ask, max_output_tokens=8, temperature=2.0, extra_body={"seed": s}
        ).output_text
        for s in range(4)
    }
    assert len(hot) > 1  # sampling at temperature 2 differs between seeds


def test_streamed_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 7, "temperature": 0}
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 7


@pytest.mark.needs_structured_output
def test_the_stream_helper_gets_the_final_response(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "size", "schema": SIZE}
    with client.responses.stream(model=MODEL, input="Size?", text={"format": fmt}, max_output_tokens=20) as stream:  # type: ignore[typeddict-item]
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text) in SIZE["enum"]
    assert "".join(texts) == final.output_text


@pytest.mark.needs_structured_output
def test_a_json_schema_constrains_the_output(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    args: dict[str, Any] = {"model": MODEL, "input": "A city", "max_output_tokens": 120}
    replies = [client.responses.create(**args, text={"format": fmt}, extra_body={"seed": s}) for s in range(3)]
    done = [r for r in replies if r.status == "completed"]
    assert done, "a tiny random model closes a 2-field object well within 120 tokens"
    for r in done:
        jsonschema.validate(json.loads(r.output_text), CITY)
        assert r.text is not None and r.text.format.type == "json_schema"

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        size: Literal["small", "big"]

    parsed = [  # seeded: whether any completes must not rest on unseeded draws
        client.responses.parse(**args, text_format=City, temperature=t, extra_body={"seed": 5}) for t in (0.0, 0.5, 1.0)
    ]
    assert any(isinstance(p.output_parsed, City) for p in parsed if p.status == "completed")
    objects = [client.responses.create(**args, text={"format": {"type": "json_object"}}) for _ in range(3)]
    for obj in objects:
        if obj.status == "completed":
            assert isinstance(json.loads(obj.output_text), dict)


@pytest.mark.needs_structured_output
def test_a_function_tool_is_called_streamed_and_not(tools_server: RunningServer) -> None:
    with _client(tools_server) as client:
        # Seeded (as tests/server/test_tools.py's forced calls are): an unseeded draw at temperature 1 could run
        # a call's JSON past max_output_tokens.
        args: dict[str, Any] = {
            "model": "tiny-tools",
            "input": "Weather in Paris?",
            "tools": FLAT_TOOLS,
            "extra_body": {"seed": 1},
        }
        r = client.responses.create(**args, tool_choice="required", parallel_tool_calls=False, max_output_tokens=300)
        assert r.status == "completed"
        (call,) = [item for item in r.output if item.type == "function_call"]
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        named = {"type": "function", "name": "search"}
        events = list(client.responses.create(**args, tool_choice=named, max_output_tokens=300, stream=True))
        added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
        assert added and added[0].name == "search" and added[0].arguments == ""
        pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert pieces == done.arguments and json.loads(done.arguments)
        assert events[-1].type == "response.completed" and events[-1].response.output[-1].arguments == done.arguments
        # The call and its output go back as input items: the next turn's prompt holds both.
        turn = [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ]
        before = client.responses.create(model="tiny-tools", input=turn[:1], tools=FLAT_TOOLS, max_output_tokens=1)
        after = client.responses.create(model="tiny-tools", input=turn, tools=FLAT_TOOLS, max_output_tokens=1)
        assert after.usage is not None and before.usage is not None
        assert after.usage.input_tokens > before.usage.input_tokens + 10
        none = client.responses.create(**args, tool_choice="none", max_output_tokens=5)
        assert [item.type for item in none.output] == ["message"]


def test_a_thinking_models_reasoning_is_a_reasoning_item(thinking_server: RunningServer) -> None:
    """The template opens <think> and a random model never closes it: everything is reasoning."""
    with _client(thinking_server) as client:
        r = client.responses.create(model="tiny-thinking", input="Why?", max_output_tokens=5, temperature=0)
        (item,) = r.output
        assert item.type == "reasoning" and item.content is not None and item.content[0].text
        args: dict[str, Any] = {"model": "tiny-thinking", "input": "Why?", "max_output_tokens": 5, "temperature": 0}
        events = list(client.responses.create(**args, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == item.content[0].text
        (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
        assert done.text == deltas
        past = {
            "type": "reasoning",
            "id": item.id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "abc"}],
        }
        answer = {"role": "assistant", "content": "Yes."}
        plain = client.responses.create(
            model="tiny-thinking", input=[answer, {"role": "user", "content": "ok"}], max_output_tokens=1
        )
        kept = client.responses.create(
            model="tiny-thinking", input=[past, answer, {"role": "user", "content": "ok"}], max_output_tokens=1
        )
        assert kept.usage is not None and plain.usage is not None and kept.usage.input_tokens > plain.usage.input_tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objct"}}}}, "text.format"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"model": "nope"}, "model"),
    ],
)
def test_refusals_name_the_field(server: RunningServer, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **extra}
    r = httpx.post(f"{server.base_url}/responses", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()
