"""`/v1/completions` with `echo`: the prompt before the completion, and with `logprobs` the prompt tokens'
logprobs in OpenAI's legacy shape (null first), as evaluation harnesses call it to score a text:
`echo=True, logprobs=k, max_tokens=0` (or 1). Values against a float32 transformers forward pass."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from asyncllm import AsyncLLMEngine
from tests.server.conftest import MODEL

PROMPT = "The capital of France is Paris."


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    """log_softmax of a float32 transformers forward over a prompt: [len(ids), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="eager").eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return logprobs


def _check_prompt_logprobs(lp: Any, ids: list[int], engine: AsyncLLMEngine, reference: Any, k: int) -> None:
    """The first len(ids) entries of `lp` (a completion's logprobs) score the prompt `ids` as `reference` does."""
    want = reference(ids)
    n = len(ids)
    decode = engine.tokenizer.decode
    assert lp.tokens[:n] == [decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for i in range(1, n):
        assert math.isclose(lp.token_logprobs[i], want[i - 1, ids[i]].item(), abs_tol=1e-5)
        top_values, top_ids = want[i - 1].topk(k)
        top = lp.top_logprobs[i]
        # The k most likely and the prompt's own token (two ids may decode to one string: pieces of a character)
        assert len(top) <= k + 1 and top[lp.tokens[i]] == lp.token_logprobs[i]
        assert math.isclose(max(top.values()), top_values[0].item(), abs_tol=1e-5)
        for token, value in top.items():
            assert token == lp.tokens[i] or any(
                decode([int(t)]) == token and math.isclose(value, v, abs_tol=1e-5)
                for v, t in zip(top_values.tolist(), top_ids)
            )


def test_echo_scores_the_prompt_alone(client: openai.OpenAI, engine: AsyncLLMEngine, reference: Any) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    (choice,) = r.choices
    ids = engine.tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    _check_prompt_logprobs(lp, ids, engine, reference, 2)
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    # without logprobs: the prompt's text alone
    plain = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_echo_with_a_completion_as_harnesses_ask(client: openai.OpenAI, engine: AsyncLLMEngine, reference: Any) -> None:
    """lm-evaluation-harness: token-id prompts in a batch, echo, logprobs=1, max_tokens=1, greedy; it drops the
    last (generated) entry and reads the rest."""
    prompts = [engine.tokenizer.encode(PROMPT), engine.tokenizer.encode("Hello world! Streaming")]
    r = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    for ids, choice in zip(prompts, r.choices):
        alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1)
        prompt_text = engine.tokenizer.decode(ids)
        assert choice.text == prompt_text + alone.choices[0].text
        lp = choice.logprobs
        assert lp is not None and len(lp.tokens) == len(ids) + 1
        _check_prompt_logprobs(lp, ids, engine, reference, 1)
        gen = alone.choices[0].logprobs
        assert gen is not None and gen.tokens is not None and gen.token_logprobs is not None
        assert lp.tokens[-1] == gen.tokens[0]  # batched or alone: the same token, to float rounding
        assert math.isclose(lp.token_logprobs[-1], gen.token_logprobs[0], abs_tol=1e-5)
        assert lp.text_offset[-1] == len(prompt_text)  # the completion's offsets follow the echoed text
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_echo_streamed_equals_whole(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=3, temperature=0)
    for max_tokens in (0, 5):
        whole = client.completions.create(**kwargs, max_tokens=max_tokens)
        chunks = list(client.completions.create(**kwargs, max_tokens=max_tokens, stream=True))
        assert chunks[0].choices[0].text.startswith(PROMPT)  # the prompt comes first, whole
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        want = whole.choices[0].logprobs
        assert want is not None
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for lp in lps for v in getattr(lp, name)] == getattr(want, name), name
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_echo_with_n_choices(client: openai.OpenAI, engine: AsyncLLMEngine) -> None:
    """Each of a prompt's n choices opens with the prompt and its logprobs (computed once, for the request)."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, n=3, seed=5)
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    heads = [(c.logprobs.tokens[:n_prompt], c.logprobs.token_logprobs[:n_prompt]) for c in r.choices]  # type: ignore[union-attr,index]
    assert all(c.text.startswith(PROMPT) for c in r.choices) and heads[1:] == heads[:1] * 2
    assert all(len(c.logprobs.tokens) == n_prompt + 3 for c in r.choices)  # type: ignore[union-attr,arg-type]
    streamed = list(
        client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=3, n=3, seed=5, stream=True)
    )
    for i in range(3):
        text = "".join(c.choices[0].text for c in streamed if c.choices[0].index == i)
        assert text == r.choices[i].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"echo": True, "logprobs": 21}, "logprobs"),
        ({"echo": True, "logprobs": -1, "max_tokens": 0}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # no echo: nothing to answer with
        ({"echo": True, "max_tokens": -1}, "max_tokens"),
        ({"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ],
)
def test_bad_echo_requests_name_the_field(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"max_tokens": 2, **extra})
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert param in body["message"]
