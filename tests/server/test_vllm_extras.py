"""vLLM's extra request fields on both OpenAI endpoints, each shown to take effect (sent as the openai client
sends them, through `extra_body`), and the small endpoints vLLM's clients call: /tokenize, /detokenize,
/version, `max_model_len` in /v1/models."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from asyncllm import AsyncLLMEngine
from tests.server.conftest import MODEL
from tests.server.serving import RunningServer

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story about the sea."}]
PROMPT = "Once upon a time there was a"


def _completion(client: openai.OpenAI, **extra: Any) -> Any:
    return client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"return_token_ids": True, **extra}
    )


def test_stop_token_ids_end_the_reply(client: openai.OpenAI) -> None:
    free = _completion(client)
    ids = free.choices[0].token_ids
    assert len(ids) == 8 and free.choices[0].finish_reason == "length"
    stop = ids[2]
    stopped = _completion(client, stop_token_ids=[stop])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.token_ids == ids[: ids.index(stop) + 1]


def test_logit_bias_moves_the_draw(client: openai.OpenAI) -> None:
    """OpenAI's logit_bias (refused with a 400 before): -100 rules a token out, +100 all but forces it."""
    free = _completion(client).choices[0].token_ids
    banned = _completion(client, logit_bias={str(free[0]): -100}).choices[0].token_ids
    assert banned[0] != free[0] and free[0] not in banned
    forced = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3, logit_bias={"77": 100}
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, logit_bias={"77": 100}, extra_body={"return_token_ids": True}
    )
    assert forced.usage is not None and forced.usage.completion_tokens == 4
    assert chat.choices[0].token_ids == [77] * 4  # type: ignore[attr-defined]


def test_min_tokens_hold_back_the_stop_ids(client: openai.OpenAI) -> None:
    first = _completion(client).choices[0].token_ids[0]
    assert len(_completion(client, stop_token_ids=[first]).choices[0].token_ids) == 1
    held = _completion(client, stop_token_ids=[first], min_tokens=4).choices[0]
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:3]


def test_return_token_ids_streamed_and_not(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    whole = _completion(client).choices[0]
    assert whole.prompt_token_ids == engine.tokenizer(PROMPT).input_ids
    assert engine.tokenizer.decode(whole.token_ids) == whole.text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"return_token_ids": True}
        )
    )
    assert chunks[0].choices[0].prompt_token_ids == whole.prompt_token_ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == whole.token_ids

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    prompt_ids = chat.prompt_token_ids  # type: ignore[attr-defined]
    assert chat.usage is not None and len(prompt_ids) == chat.usage.prompt_tokens
    assert len(chat.choices[0].token_ids) == chat.usage.completion_tokens  # type: ignore[attr-defined]
    streamed = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
    )
    assert streamed[0].prompt_token_ids == prompt_ids  # type: ignore[attr-defined]
    got = [t for c in streamed for choice in c.choices for t in (choice.token_ids or [])]  # type: ignore[attr-defined]
    assert got == chat.choices[0].token_ids  # type: ignore[attr-defined]


def test_prompt_logprobs_score_the_prompt(client: openai.OpenAI) -> None:
    r = _completion(client, prompt_logprobs=2)
    choice = r.choices[0]
    scored = choice.prompt_logprobs
    assert len(scored) == len(choice.prompt_token_ids) and scored[0] is None
    for token_id, entry in zip(choice.prompt_token_ids[1:], scored[1:]):
        assert str(token_id) in entry and len(entry) <= 3
        ranked = sorted((e for e in entry.values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2]
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] and all(e["logprob"] <= 0 for e in entry.values())
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0, "return_token_ids": True}
    )
    scored = chat.prompt_logprobs  # type: ignore[attr-defined]
    assert len(scored) == len(chat.prompt_token_ids) and scored[0] is None  # type: ignore[attr-defined]
    assert all(list(e) == [str(t)] for t, e in zip(chat.prompt_token_ids[1:], scored[1:]))  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1})


def test_completion_logprobs_zero_give_the_chosen_token(client: openai.OpenAI) -> None:
    """Regression: `logprobs=0` gave `{}` per token; OpenAI and vLLM give the chosen token's entry."""
    lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0).choices[0]
    assert lp.logprobs is not None and lp.logprobs.top_logprobs is not None and lp.logprobs.tokens is not None
    for token, value, top in zip(lp.logprobs.tokens, lp.logprobs.token_logprobs or [], lp.logprobs.top_logprobs):
        assert top == {token: value}


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"grammar": 'root ::= "a" | "bb"'}, lambda t: t in ("a", "bb")),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ],
    ids=["choice", "regex", "json", "grammar", "json_object"],
)
def test_structured_outputs_constrain_both_endpoints(client: openai.OpenAI, constraint: Any, check: Any) -> None:
    body = {"structured_outputs": constraint}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, seed=1, extra_body=body)
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, seed=1, extra_body=body)
    assert text.choices[0].finish_reason == "stop" and check(text.choices[0].text)


def test_structured_outputs_refusals_name_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="structured_outputs") as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"regex": "a"}},
        )
    assert caught.value.body["param"] == "structured_outputs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"structured_outputs": {"regex": "("}})
    assert caught.value.body["param"] == "structured_outputs.regex"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt=PROMPT, extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}
        )
    assert caught.value.body["param"].startswith("structured_outputs.")  # type: ignore[index]


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    ids = engine.tokenizer(PROMPT).input_ids
    cut = _completion(client, truncate_prompt_tokens=3).choices[0]
    assert cut.prompt_token_ids == ids[-3:]
    same = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=8, temperature=0)
    assert same.choices[0].text == cut.text
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        _completion(client, truncate_prompt_tokens=0)


def test_continuous_usage_stats_on_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    done = [u.completion_tokens for u in usages if u is not None]
    assert done == sorted(done) and done[-1] == 6 and len(set(u.prompt_tokens for u in usages if u)) == 1
    chat = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"ignore_eos": True},  # the count is exact only if EOS cannot end the reply first
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 4  # type: ignore[union-attr]


def test_cached_tokens_count_prefix_cache_hits(client: openai.OpenAI) -> None:
    prompt = "The prefix cache serves this long prompt the second time it is sent, block by block. " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage is not None and again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached < again.usage.prompt_tokens
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None


def test_tokenize_detokenize_version_models(server: RunningServer, engine: AsyncLLMEngine) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == engine.tokenizer(PROMPT).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > body["count"]
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": engine.tokenizer.decode(body["tokens"])}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{server.url}/tokenize", json={}).status_code == 400
    assert httpx.get(f"{server.url}/version").json()["version"]
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["max_model_len"] == 512
