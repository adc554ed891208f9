"""Every finished output of the tiny random model satisfies its constraint, whatever the seed and draw:
JSON schemas (objects, nested objects, enums, bounded integers, arrays with min/max items, bounded strings,
anyOf, a top-level array), any JSON object, a regex, a choice, an EBNF grammar; bounded constraints finish
with EOS ("stop") once complete. Constrained and unconstrained requests share batches; the unconstrained
ones get exactly the tokens they get alone."""

from __future__ import annotations

import codecs
import itertools
import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from asyncllm import LLM, SamplingParams
from asyncllm.core.byte_level import ByteLevelPieces
from asyncllm.core.detokenizer import backend_tokenizer
from tests.structured.conftest import CONSTRAINTS, DRAWS, MAX_TOKENS, check, constrained

PROMPTS = ["Hello", [5, 6, 7, 8], "The capital of France is", "日本語のテキスト"]


def test_every_output_satisfies_its_constraint(llm: LLM) -> None:
    cases = [(n, d, s) for n, d, s in itertools.product(CONSTRAINTS, DRAWS, range(3)) if d != "greedy" or s == 0]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    outputs = llm.generate(prompts, [constrained(*case) for case in cases], use_tqdm=False)
    for (name, draw, seed), out in zip(cases, outputs):
        assert out.finish_reason == "stop", (name, draw, seed, out.text)
        check(name, out.text)
    # The random model does use its freedom: not every seed writes the same thing.
    assert len({out.text for out in outputs}) > len(CONSTRAINTS) * 2


def test_outputs_are_valid_utf8(llm: LLM) -> None:
    """Regression: xgrammar lets a JSON string (and any free character) take UTF-8 encoded surrogates and
    overlong forms, which the random model samples and the text then shows as U+FFFD; the engine's UTF-8
    mask keeps every constrained output valid UTF-8."""
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}
    params = [SamplingParams(json_schema=schema, temperature=1.0, seed=s, max_tokens=60) for s in range(24)]
    pieces = ByteLevelPieces(backend_tokenizer(llm.tokenizer))
    for out in llm.generate(["Hello"] * len(params), params, use_tqdm=False):
        data = b"".join(pieces[t] for t in out.token_ids)
        # An output cut by max_tokens may end inside a character: only an invalid byte raises before the end.
        codecs.getincrementaldecoder("utf-8")().decode(data, final=out.finish_reason != "length")


def test_pydantic_model_class(llm: LLM) -> None:
    class Point(BaseModel):
        x: int = Field(ge=-9, le=9)
        label: str = Field(max_length=4)
        kind: Literal["a", "b"]

    params = [SamplingParams(json_schema=Point, temperature=1.0, seed=s, max_tokens=MAX_TOKENS) for s in range(3)]
    for out in llm.generate(["Hi"] * 3, params, use_tqdm=False):
        assert out.finish_reason == "stop"
        Point.model_validate_json(out.text, strict=True)


def test_json_object_is_a_dict(llm: LLM) -> None:
    params = [
        SamplingParams(json_object=True, temperature=t, seed=s, max_tokens=MAX_TOKENS)
        for t in (0.0, 1.0)
        for s in range(4)
    ]
    outputs = llm.generate(["Hi"] * len(params), params, use_tqdm=False)
    finished = [out for out in outputs if out.finish_reason == "stop"]
    assert finished, "some free-form JSON object completes within max_tokens"
    for out in finished:
        assert isinstance(json.loads(out.text), dict), out.text
    for out in outputs:  # one cut by max_tokens is still a prefix of an object
        assert out.text.startswith("{"), out.text


def test_unconstrained_neighbours_pay_nothing(llm: LLM) -> None:
    free = [SamplingParams(temperature=0.9, seed=s, max_tokens=24) for s in range(3)]
    free.append(SamplingParams(temperature=0.0, max_tokens=24, logprobs=2))
    alone = llm.generate(PROMPTS[: len(free)], free, use_tqdm=False)
    names = list(CONSTRAINTS)
    mixed_params = [p for pair in zip(free, (constrained(names[i], "t1", i) for i in range(len(free)))) for p in pair]
    mixed_prompts = [p for p in PROMPTS[: len(free)] for _ in range(2)]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    for want, got in zip(alone, mixed[0::2]):
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        if want.logprobs is not None:  # float32 sums over another batch may round differently
            assert got.logprobs is not None
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)
    for i, out in enumerate(mixed[1::2]):
        check(names[i], out.text)


@pytest.mark.parametrize("name", ["person", "regex"])
def test_logprobs_and_stop_strings_compose(llm: LLM, name: str) -> None:
    """Logprobs are those of the raw logits (before the mask), one per token; a stop string may end a
    constrained output early (the caller's choice), and the output is then a prefix of a valid one."""
    params = constrained(name, "t1", 11, logprobs=3)
    out = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    check(name, out.text)
    cut = out.text[len(out.text) // 2 :][:2]
    # With logprobs too: such a request draws every token (no jump-forward), so it draws `out`'s tokens.
    stopped = llm.generate(["Hello"], constrained(name, "t1", 11, logprobs=3, stop=[cut]), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and out.text.startswith(stopped.text) and cut not in stopped.text
