"""POST /v1/messages with the official anthropic client's `messages.create` / `messages.stream`: text, system,
stop sequences (stop_reason `stop_sequence` naming the one matched), sampling fields, tool use (any / tool /
none, tool_result round trips), thinking blocks, Anthropic's stream events, `x-api-key`, and errors in
Anthropic's shape naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.chat import apply_chat_template
from asyncllm.server import create_app
from tests.fixtures.chat_templates import THINKING
from tests.server.conftest import API_KEY
from tests.server.serving import RunningServer, start_server
from tests.server.test_tools import SCHEMAS

MODEL = "tiny"
TOOLS: list[Any] = [{"name": name, "description": f"{name} tool", "input_schema": s} for name, s in SCHEMAS.items()]
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
# Qwen3's switch: with enable_thinking false the prompt closes an empty reasoning block.
TOGGLED = THINKING.replace(
    "<|im_start|>assistant\n<think>\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}",
)


@pytest.fixture(scope="module")
def thinking_server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(engine, served_model_name="tiny-thinking", chat_template=TOGGLED))
    yield running
    running.stop()


def _client(server: RunningServer, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture
def aclient(server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with _client(server) as c:
        yield c


def test_text_and_system(aclient: anthropic.Anthropic, engine: AsyncLLMEngine) -> None:
    m = aclient.messages.create(
        model=MODEL, max_tokens=6, system="Be brief.", messages=[{"role": "user", "content": "Hi"}], **GREEDY
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    (block,) = m.content
    assert block.type == "text" and block.text
    assert m.usage.output_tokens == 6
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = apply_chat_template(engine.tokenizer, conversation)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(
        engine.tokenizer.encode(prompt, add_special_tokens=False)
    )
    blocks = aclient.messages.create(
        model=MODEL, max_tokens=1, system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    )  # fmt: skip
    total = blocks.usage.input_tokens + (blocks.usage.cache_read_input_tokens or 0)
    assert total == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_stop_sequences_say_which_matched(aclient: anthropic.Anthropic) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], **GREEDY}
    free = aclient.messages.create(max_tokens=24, **args).content[0]
    assert free.type == "text" and len(free.text) > 8
    # Two characters that first occur past the start: the reply stops right before them.
    at = next(i for i in range(3, len(free.text) - 1) if free.text.find(free.text[i : i + 2]) == i)
    stop, expected = free.text[at : at + 2], free.text[:at]
    m = aclient.messages.create(max_tokens=24, stop_sequences=["\x00never", stop], **args)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content and m.content[0].type == "text" and m.content[0].text == expected
    with aclient.messages.stream(max_tokens=24, stop_sequences=[stop], **args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_sampling_fields_take_effect(aclient: anthropic.Anthropic) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], "max_tokens": 8}
    # The anthropic client (2.x) takes temperature, top_p and top_k through extra_body.
    greedy = aclient.messages.create(**args, **GREEDY).content[0]
    top_k = aclient.messages.create(**args, extra_body={"temperature": 1, "top_k": 1}).content[0]
    top_p = aclient.messages.create(**args, extra_body={"temperature": 1, "top_p": 1e-9}).content[0]
    assert greedy.type == top_k.type == top_p.type == "text"
    assert greedy.text == top_k.text == top_p.text
    # Seeded: four unseeded draws could all match (or one open with EOS, leaving no content block).
    hot = {aclient.messages.create(**args, extra_body={"temperature": 1, "seed": s}).content[0].text for s in range(4)}  # type: ignore[union-attr]
    assert len(hot) > 1


@pytest.mark.needs_structured_output
def test_output_config_format_constrains_the_reply(aclient: anthropic.Anthropic) -> None:
    size = {"enum": ["small", "big"]}
    m = aclient.messages.create(
        model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Size?"}],
        output_config={"format": {"type": "json_schema", "schema": size}},
    )  # fmt: skip
    assert m.stop_reason == "end_turn" and m.content[0].type == "text"
    assert json.loads(m.content[0].text) in size["enum"]


def test_stream_events_in_anthropic_order(aclient: anthropic.Anthropic) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], "max_tokens": 5}
    events = list(aclient.messages.create(stream=True, **args, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens > 0 and events[0].message.content == []
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 5
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == aclient.messages.create(**args, **GREEDY).content[0].text  # type: ignore[union-attr]


@pytest.mark.needs_structured_output
def test_a_tool_is_used_and_its_result_sent_back(tools_server: RunningServer) -> None:
    with _client(tools_server) as client:
        # Seeded (as tests/server/test_tools.py's forced calls are): an unseeded draw at temperature 1 could run
        # a call's JSON past max_tokens, or end the reply asserted to reach it with EOS.
        args: dict[str, Any] = {
            "model": "tiny-tools",
            "messages": ASK,
            "tools": TOOLS,
            "max_tokens": 300,
            "extra_body": {"seed": 1},
        }
        m = client.messages.create(**args, tool_choice={"type": "any", "disable_parallel_tool_use": True})
        assert m.stop_reason == "tool_use"
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.id.startswith("toolu_") and use.name in SCHEMAS
        jsonschema.validate(use.input, SCHEMAS[use.name])
        with client.messages.stream(**args, tool_choice={"type": "tool", "name": "search"}) as stream:
            events = list(stream)
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use"
        uses = [b for b in final.content if b.type == "tool_use"]
        assert uses and all(b.name == "search" for b in uses)
        partial = "".join(e.partial_json for e in events if e.type == "input_json")
        assert json.loads(partial) == uses[0].input or len(uses) > 1
        jsonschema.validate(uses[0].input, SCHEMAS["search"])
        none = client.messages.create(**{**args, "max_tokens": 5}, tool_choice={"type": "none"})
        assert [b.type for b in none.content] == ["text"] and none.stop_reason == "max_tokens"
        # The call and its result go back: the next turn's prompt holds both.
        turn = [
            *ASK,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
        ]
        before = client.messages.create(model="tiny-tools", messages=ASK, tools=TOOLS, max_tokens=1)
        after = client.messages.create(model="tiny-tools", messages=turn, tools=TOOLS, max_tokens=1)
        assert after.usage.input_tokens + (after.usage.cache_read_input_tokens or 0) > before.usage.input_tokens + 10


def test_thinking_blocks(thinking_server: RunningServer) -> None:
    """The template opens <think> and a random model never closes it: the reply is one thinking block;
    thinking disabled closes the block in the prompt, and the reply is text."""
    with _client(thinking_server) as client:
        args: dict[str, Any] = {"model": "tiny-thinking", "messages": [{"role": "user", "content": "Why?"}]}
        m = client.messages.create(**args, max_tokens=5, **GREEDY)
        (block,) = m.content
        assert block.type == "thinking" and block.thinking
        with client.messages.stream(**args, max_tokens=5, **GREEDY) as stream:
            thought = "".join(e.thinking for e in stream if e.type == "thinking")
        assert thought == block.thinking
        enabled = {"type": "enabled", "budget_tokens": 4}
        # Greedy: an unseeded draw could open the reply with EOS, leaving no block to look at.
        assert client.messages.create(**args, max_tokens=5, thinking=enabled, **GREEDY).content[0].type == "thinking"
        off = client.messages.create(**args, max_tokens=5, thinking={"type": "disabled"}, **GREEDY)
        assert [b.type for b in off.content] == ["text"]


def test_x_api_key_and_bearer(keyed_server: RunningServer) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with _client(keyed_server, API_KEY) as client:  # sends x-api-key
        assert client.messages.create(**args).usage.output_tokens == 1
    bearer = httpx.post(
        f"{keyed_server.url}/v1/messages", json=args, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    assert bearer.status_code == 200
    with _client(keyed_server, "wrong") as client, pytest.raises(anthropic.AuthenticationError) as info:
        client.messages.create(**args)
    assert info.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": info.value.body["error"]["message"]},
    }  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 99}}, "thinking.budget_tokens"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "objct"}}}}, "output_config.format"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_bad_requests_are_anthropic_400s_naming_the_field(
    server: RunningServer, extra: dict[str, Any], field: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert field in error["error"]["message"], error
    if "max_tokens" in body:  # the client refuses to send a request without it
        known = {k: body.pop(k) for k in ("model", "messages", "max_tokens")}
        with _client(server) as client, pytest.raises(anthropic.BadRequestError):
            client.messages.create(**known, extra_body=body)


def test_a_body_past_the_byte_bound_is_anthropics_413_unread(server: RunningServer) -> None:
    """The Messages API reads a body as the OpenAI endpoints do: no further than the server's byte bound
    (issue 39), refused by its Content-Length before any of it is read."""
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "b " * 3_000_000}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 413 and r.headers["connection"] == "close", r.text[:300]
    error = r.json()
    assert error["type"] == "error" and "more than the" in error["error"]["message"], error


def test_an_unknown_model_is_anthropics_not_found(aclient: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        aclient.messages.create(model="nope", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
