"""The Responses and Messages APIs on a real model (SmolLM2-135M-Instruct, the built-in default, on CPU) with the
official openai and anthropic clients: an answer in words, a JSON schema, a stop sequence, a forced tool call
(served with a Hermes template: SmolLM2's own lists no tools)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.server import create_app
from tests.fixtures.chat_templates import HERMES
from tests.fixtures.default_model import smollm2_path
from tests.server.serving import RunningServer, start_server

pytestmark = pytest.mark.slow
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
CITY = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon", "Rome"]}}, "required": ["capital"]}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smol_server() -> Iterator[RunningServer]:
    engine = AsyncLLMEngine(str(smollm2_path()), device="cpu", num_kv_blocks=64, max_model_len=1024)
    running = start_server(create_app(engine, served_model_name="smollm2", chat_template=HERMES))
    yield running
    running.stop()
    engine.shutdown()


def test_openai_responses(smol_server: RunningServer) -> None:
    with openai.OpenAI(base_url=smol_server.base_url, api_key="x", max_retries=0, timeout=300) as client:
        ask: dict[str, Any] = {"model": "smollm2", "input": QUESTION, "temperature": 0}
        r = client.responses.create(**ask, max_output_tokens=30)
        assert "Paris" in r.output_text
        streamed = list(client.responses.create(**ask, max_output_tokens=30, stream=True))
        assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == r.output_text
        fmt: Any = {"type": "json_schema", "name": "city", "schema": CITY}
        j = client.responses.create(**ask, text={"format": fmt}, max_output_tokens=40)
        assert json.loads(j.output_text) == {"capital": "Paris"}
        tool: Any = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": None}
        t = client.responses.create(
            model="smollm2", input="Weather in Rome?", tools=[tool], tool_choice="required", parallel_tool_calls=False,
            max_output_tokens=120,
        )  # fmt: skip
        (call,) = [item for item in t.output if item.type == "function_call"]
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_anthropic_messages(smol_server: RunningServer) -> None:
    with anthropic.Anthropic(base_url=smol_server.url, api_key="x", max_retries=0, timeout=300) as client:
        ask: Any = [{"role": "user", "content": QUESTION}]
        greedy = {"extra_body": {"temperature": 0}}
        m = client.messages.create(model="smollm2", max_tokens=30, messages=ask, **greedy)
        assert m.content[0].type == "text" and "Paris" in m.content[0].text
        with client.messages.stream(
            model="smollm2", max_tokens=30, messages=ask, stop_sequences=["Paris"], **greedy
        ) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris" and "Paris" not in text
        tool: Any = {"name": "get_weather", "input_schema": WEATHER}
        t = client.messages.create(
            model="smollm2", max_tokens=120, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[tool],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )  # fmt: skip
        assert t.stop_reason == "tool_use"
        (use,) = [b for b in t.content if b.type == "tool_use"]
        jsonschema.validate(use.input, WEATHER)
