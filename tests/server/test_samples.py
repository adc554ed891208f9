"""`n` on /v1/completions and /v1/chat/completions: one engine request per prompt (`SamplingParams.n`, the
prompt prefilled once and its blocks shared), choices indexed prompt by prompt; with a seed, choice j draws
as a request seeded seed + j; bad `n` is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from asyncllm import AsyncLLMEngine
from tests.server.conftest import MODEL, wait_drained
from tests.server.serving import RunningServer

PROMPT = list(range(20, 61))  # 41 token ids: 10 full blocks of 4 shared by every sample


def test_choices_equal_requests_seeded_seed_plus_index(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0)
    r = client.completions.create(**kwargs, n=3, seed=40)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, choice in enumerate(r.choices):
        alone = client.completions.create(**kwargs, seed=40 + j)
        assert (choice.text, choice.finish_reason) == (alone.choices[0].text, alone.choices[0].finish_reason)
    assert len({c.text for c in r.choices}) > 1
    assert r.usage is not None and r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == 18


def test_prompts_times_samples_are_indexed_prompt_by_prompt(client: openai.OpenAI) -> None:
    prompts = [PROMPT, [5, 6, 7]]
    kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=4, temperature=1.0, seed=9)
    r = client.completions.create(**kwargs, prompt=prompts, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(**kwargs, prompt=prompt, n=2)
        assert [c.text for c in r.choices[2 * i : 2 * i + 2]] == [c.text for c in alone.choices]


def test_streamed_samples_join_to_the_whole_ones_while_sharing_blocks(
    server: RunningServer, engine: AsyncLLMEngine
) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 3,
        "n": 4,
        "ignore_eos": True,
    }
    total = engine.stats()["num_total_blocks"]
    peak = 0
    events = []
    with httpx.stream("POST", f"{server.base_url}/completions", json={**body, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
                peak = max(peak, total - engine.stats()["num_free_blocks"])
    # 10 shared blocks and 1 to 3 of each sample's own (4 separate requests: 11 to 13 blocks each).
    assert 0 < peak <= 10 + 4 * 3
    whole = httpx.post(f"{server.base_url}/completions", json=body, timeout=30).json()
    for j in range(4):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == j]
        assert "".join(c["text"] for c in mine) == whole["choices"][j]["text"]
        assert [c["finish_reason"] for c in mine][-1] == whole["choices"][j]["finish_reason"] == "length"
    wait_drained(engine, 10)


@pytest.mark.parametrize("n", [0, -1, 129, "two", 1.5])
def test_bad_n_is_a_400_naming_n(client: openai.OpenAI, n: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=n)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "n", info.value.body


def test_best_of_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=2)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "best_of", info.value.body


CHAT = [{"role": "user", "content": "Tell me about the weather in Paris and in Rome, in a few words. " * 2}]


def test_chat_choices_equal_requests_seeded_seed_plus_index(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, logprobs=True)
    r = client.chat.completions.create(**kwargs, n=3, seed=40, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, choice in enumerate(r.choices):
        alone = client.chat.completions.create(**kwargs, seed=40 + j, top_logprobs=2).choices[0]
        assert (choice.message.content, choice.finish_reason) == (alone.message.content, alone.finish_reason)
        assert choice.logprobs is not None and alone.logprobs is not None
        mine, its = choice.logprobs.content or [], alone.logprobs.content or []
        assert [(t.token, [x.token for x in t.top_logprobs]) for t in mine] == [
            (t.token, [x.token for x in t.top_logprobs]) for t in its
        ]
        assert [t.logprob for t in mine] == pytest.approx([t.logprob for t in its], abs=1e-4)  # batch shapes differ
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage is not None and r.usage.completion_tokens == 18


def test_streamed_chat_samples_join_to_the_whole_ones_while_sharing_blocks(
    server: RunningServer, engine: AsyncLLMEngine
) -> None:
    # A conversation no other test sends: the prefix cache holds none of its blocks when it streams.
    messages = [{"role": "user", "content": "Describe the harbour of Oslo at dawn, then at dusk. " * 3}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3}
    body |= {"ignore_eos": True, "logprobs": True}
    total = engine.stats()["num_total_blocks"]
    peak = live = 0
    events = []
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**body, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
                peak = max(peak, total - engine.stats()["num_free_blocks"])
                live = max(live, engine.num_live_requests)
    assert live == 1  # the n samples are one engine request
    whole = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30).json()
    prompt_blocks = whole["usage"]["prompt_tokens"] // 4
    assert prompt_blocks >= 10
    # The prompt's full blocks once, and 1 to 3 of each sample's own (3 separate requests: 3 times the prompt).
    assert 0 < peak <= prompt_blocks + 3 * 3, (peak, prompt_blocks)
    choices = [e["choices"][0] for e in events]
    assert [c["delta"] for c in choices[:3]] == [{"role": "assistant", "content": ""}] * 3
    assert [c["index"] for c in choices[:3]] == [0, 1, 2]
    for j in range(3):
        mine = [c for c in choices[3:] if c["index"] == j]
        assert "".join(c["delta"].get("content") or "" for c in mine) == whole["choices"][j]["message"]["content"]
        tokens = [t["token"] for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert tokens == [t["token"] for t in whole["choices"][j]["logprobs"]["content"]]
        assert mine[-1]["finish_reason"] == whole["choices"][j]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    wait_drained(engine, 10)
