"""Reasoning over HTTP, for a thinking model's template (the prompt opens `<think>`): the reply's reasoning
is `reasoning_content`, in the message and in streamed deltas, apart from `content`; a past turn's reasoning
reaches the template; logprobs cover every token however the reply is split."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.chat import apply_chat_template
from asyncllm.server import create_app
from tests.fixtures.chat_templates import THINKING
from tests.server.serving import RunningServer, start_server

MODEL = "tiny-thinking"
ASK: list[Any] = [{"role": "user", "content": "Is it sunny?"}]
# A random model's reply, forced: three letters of reasoning, the end tag, two of answer.
FORCED: dict[str, Any] = {"regex": "[a-c]{3}</think>\\n\\n[x-z]{2}"}


@pytest.fixture(scope="module")
def thinking_server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    running = start_server(create_app(engine, served_model_name=MODEL, chat_template=THINKING))
    yield running
    running.stop()


@pytest.fixture
def thinking_client(thinking_server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=thinking_server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _stream(server: RunningServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.needs_structured_output
def test_reasoning_is_split_from_the_answer(thinking_client: openai.OpenAI, thinking_server: RunningServer) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 40, "seed": 2}
    r = thinking_client.chat.completions.create(**args, extra_body=FORCED)
    message = r.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert reasoning is not None and len(reasoning) == 3 and set(reasoning) <= set("abc"), message
    assert message.content is not None and len(message.content) == 2 and set(message.content) <= set("xyz")
    assert r.choices[0].finish_reason == "stop"
    events = _stream(thinking_server, {**args, **FORCED, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert all(len(d) == 1 and set(d) <= {"reasoning_content", "content"} for d in deltas[1:-1]), deltas
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("content" not in d for d in deltas[1:first_content])  # reasoning comes first
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == message.content


def test_a_reply_without_reasoning_has_no_reasoning_field(client: openai.OpenAI) -> None:
    """The session server's template (plain ChatML) does not think: no `reasoning_content` key at all."""
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    assert "reasoning_content" not in r.choices[0].message.model_dump(exclude_unset=True)


def test_a_past_turns_reasoning_reaches_the_template(thinking_client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    def prompt_tokens(**reasoning: str) -> int:
        turn = {"role": "assistant", "content": "Yes.", **reasoning}
        messages = [*ASK, turn, {"role": "user", "content": "Sure?"}]
        r = thinking_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        assert r.usage is not None
        return r.usage.prompt_tokens

    history = [*ASK, {"role": "assistant", "content": "Yes.", "reasoning_content": "It is noon."}]
    history.append({"role": "user", "content": "Sure?"})
    want = len(apply_chat_template(engine.tokenizer, history, chat_template=THINKING, tokenize=True))
    assert prompt_tokens(reasoning_content="It is noon.") == want > prompt_tokens()
    assert prompt_tokens(reasoning="It is noon.") == want  # vLLM's newer name for it


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_cover_every_token_of_a_split_reply(thinking_server: RunningServer, stream: bool) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 12, "seed": 5, "logprobs": True, "top_logprobs": 2}
    if not stream:
        r = httpx.post(f"{thinking_server.base_url}/chat/completions", json=body, timeout=60).json()
        assert len(r["choices"][0]["logprobs"]["content"]) == r["usage"]["completion_tokens"]
        return
    events = _stream(thinking_server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    tokens = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["content"]]
    assert len(tokens) == events[-1]["usage"]["completion_tokens"] > 0
    assert all(len(t["top_logprobs"]) == 2 for t in tokens)
