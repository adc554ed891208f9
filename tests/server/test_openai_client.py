"""The official openai client against a real server: chat and completions, streamed and not, stop strings,
seeds, logprobs, n, prompt batches, and usage figures equal to the engine's own token counts."""

from __future__ import annotations

import math
from typing import Any

import openai

from asyncllm import AsyncLLMEngine, SamplingParams
from tests.server.conftest import MODEL

MESSAGES: list[Any] = [{"role": "user", "content": "The capital of France is"}]


async def test_chat_matches_the_engine_and_counts_usage(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    prompt = engine.apply_chat_template(MESSAGES)
    want = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12))
    (choice,) = r.choices
    assert (r.object, r.model, choice.index, choice.message.role) == ("chat.completion", MODEL, 0, "assistant")
    assert choice.message.content == want.text and choice.finish_reason == want.finish_reason
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(want.token_ids))
    assert r.usage.total_tokens == len(prompt) + len(want.token_ids)


def test_chat_stream_concatenates_to_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1


async def test_completions_streamed_and_not(aclient: openai.AsyncOpenAI, engine: AsyncLLMEngine) -> None:
    want = await engine.generate("Hello world", SamplingParams(temperature=0, max_tokens=10))
    r = await aclient.completions.create(model=MODEL, prompt="Hello world", max_tokens=10, temperature=0)
    assert (r.object, r.choices[0].text, r.choices[0].finish_reason) == ("text_completion", want.text, "length")
    assert r.usage is not None and r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 10
    stream = await aclient.completions.create(
        model=MODEL, prompt=want.prompt_token_ids, max_tokens=10, temperature=0, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


async def test_stop_strings_end_the_answer_without_the_stop(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    free = await engine.generate("Hello world", SamplingParams(temperature=0, max_tokens=24))
    stop = free.text[5:8]  # a string the greedy answer is known to contain
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=24, temperature=0, stop=[stop, "@@"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free.text[: free.text.index(stop)]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=24, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_seed_reproduces_and_n_samples_differ(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kwargs, n=2)
    b = client.chat.completions.create(**kwargs, n=2)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1]
    assert texts == [c.message.content for c in b.choices]  # reproducible
    assert texts[0] != texts[1]  # sample i draws with seed + i
    single = client.chat.completions.create(**{**kwargs, "seed": 1235})
    assert single.choices[0].message.content == texts[1]
    assert a.usage is not None and a.usage.completion_tokens == 32  # n samples, the prompt counted once
    assert a.usage.prompt_tokens == single.usage.prompt_tokens  # type: ignore[union-attr]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    # byte-level tokenizer: each token's own bytes, a piece of a character included, add up to the text
    text = bytes(b for t in content for b in t.bytes or []).decode("utf-8", errors="replace")
    assert text == r.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].token == token.token  # greedy: the sampled token is the most likely
        assert math.isclose(token.top_logprobs[0].logprob, token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    # The same tokens; their logprobs to float32's rounding (the second request's prompt comes from the prefix
    # cache, so its last position is computed against cached KV: equal only to the last bits).
    assert [t.token for t in tokens] == [t.token for t in content]
    assert all(math.isclose(a.logprob, b.logprob, rel_tol=1e-5) for a, b in zip(tokens, content))
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True)
    assert plain.choices[0].logprobs.content[0].top_logprobs == []  # type: ignore[union-attr,index]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == logprob and top[token] == logprob


def test_prompt_batches_give_n_choices_each(client: openai.OpenAI) -> None:
    prompts = ["Hello", "The capital"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == alone.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 16
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert len(ids.choices) == 2 and ids.usage is not None and ids.usage.prompt_tokens == 5


def test_models_endpoint(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "asyncllm"


def test_extras_pass_through_extra_body(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=20,
        temperature=0.7,
        seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 20, "ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"
