"""Constraints and their checkers for structured-output tests, and engines on the tiny random model.

A random-weight model samples anything its mask allows, so it is the strictest client of a constraint: every
output it finishes must still satisfy it. Every constraint here has bounded outputs (bounded strings, arrays,
repetitions), so with enough `max_tokens` each request ends with EOS once its grammar is complete.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.step import ModelRunnerOutput, RuntimeInfo, SchedulerOutput, StepResult

ENGINE_ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=512, seed=7)
MAX_TOKENS = 160  # far more than any output of the constraints below takes

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
            },
            "required": ["city", "zip"],
        },
        "contact": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"}, {"type": "null"}]},
        "nick": {"type": ["string", "null"], "maxLength": 3},
    },
    "required": ["name", "age", "role", "tags", "address", "contact", "nick"],
}
SCORES = {  # an array at the top level, numbers bounded both ways, optional properties
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["id"],
    },
    "minItems": 2,
    "maxItems": 4,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org|net)( #[0-9]{1,3})?"
DOT_REGEX = r"<[^<>]{1,4}>.{2,5}"  # any characters (negated classes, `.`), counted
CHOICES = ["yes", "no", "maybe so", "日本語", 'say "hi"\n']
# Key-value pairs in parentheses: (ab=12,c=3)
GRAMMAR = r"""
root ::= "(" pair ("," pair){0,3} ")"
pair ::= key "=" value
key ::= [a-z] [a-z]?
value ::= [0-9] | [1-9] [0-9] | "true" | "false"
"""
GRAMMAR_RE = re.compile(
    r"\((?:[a-z]{1,2}=(?:[0-9]|[1-9][0-9]|true|false))(?:,[a-z]{1,2}=(?:[0-9]|[1-9][0-9]|true|false)){0,3}\)"
)

Checker = Callable[[str], None]


def _schema_checker(schema: dict[str, Any]) -> Checker:
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema)

    return check


def _json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def _regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def _dot_regex(text: str) -> None:
    assert re.fullmatch(DOT_REGEX, text), text


def _choice(text: str) -> None:
    assert text in CHOICES, text


def _grammar(text: str) -> None:
    assert GRAMMAR_RE.fullmatch(text), text


# name -> (the SamplingParams field and its value, the output's checker)
CONSTRAINTS: dict[str, tuple[dict[str, Any], Checker]] = {
    "person": ({"json_schema": PERSON}, _schema_checker(PERSON)),
    "scores": ({"json_schema": json.dumps(SCORES)}, _schema_checker(SCORES)),
    "regex": ({"regex": REGEX}, _regex),
    "dot_regex": ({"regex": DOT_REGEX}, _dot_regex),
    "choice": ({"choice": CHOICES}, _choice),
    "grammar": ({"grammar": GRAMMAR}, _grammar),
}
# Draw settings: greedy, plain temperature, and the filtered paths (masked before they filter).
DRAWS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "t1": dict(temperature=1.0),
    "hot_top_k": dict(temperature=1.5, top_k=5),
    "top_p_min_p": dict(temperature=0.8, top_p=0.9, min_p=0.05),
}


def constrained(name: str, draw: str, seed: int, **extra: Any) -> SamplingParams:
    field, _ = CONSTRAINTS[name]
    return SamplingParams(**field, **DRAWS[draw], seed=seed, max_tokens=MAX_TOKENS, **extra)


def check(name: str, text: str) -> None:
    CONSTRAINTS[name][1](text)


@pytest.fixture(scope="package")
def llm(tiny_model: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_model), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="package")
def llm_drawing(tiny_model: Path) -> Iterator[LLM]:
    """Every token drawn (`ASYNCLLM_JUMP_FORWARD=0`): the twin of paths that never jump forward (the grammar
    process, tensor parallelism)."""
    with pytest.MonkeyPatch.context() as env:  # read when the engine is built
        env.setenv("ASYNCLLM_JUMP_FORWARD", "0")
        llm = LLM(str(tiny_model), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


class _InFlight:
    """A step the device has started and not finished, as on a GPU: not done until its result is read."""

    def __init__(self, inner: StepResult) -> None:
        self._inner = inner

    def done(self) -> bool:
        return False

    def start(self) -> None:
        self._inner.start()

    def result(self) -> ModelRunnerOutput:
        return self._inner.result()


class OverlappedExecutor:
    """The real in-process executor, its steps reported in flight: the core then plans and submits step N+1
    (PLACEHOLDER inputs) before it reads step N's tokens, as on a GPU, where on CPU every step is done at once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.grammar = inner.grammar

    @property
    def runtime(self) -> RuntimeInfo:
        runtime: RuntimeInfo = self.inner.runtime
        return runtime

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        return _InFlight(self.inner.submit(scheduled))

    def shutdown(self) -> None:
        self.inner.shutdown()

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        self.inner.watch_failure(callback)


def overlapped_engine(path: Path, *, hold_masked_draws: bool = False, **engine_args: Any) -> AsyncLLMEngine:
    """An `AsyncLLMEngine` whose core overlaps every step with the next, on CPU. `hold_masked_draws`: as on
    CUDA, the runner holds each constrained step's draw until the next submit (`ModelRunner.defer_masked_draw`)."""
    from asyncllm.build import build_engine

    config = EngineConfig.from_kwargs(str(path), **engine_args).resolved(streaming=True)

    def build() -> Any:
        built = build_engine(config, time.monotonic)
        if hold_masked_draws:
            runner = built.core.executor.worker.runner
            runner.defer_masked_draw = True
        built.core.executor = OverlappedExecutor(built.core.executor)
        return built

    return AsyncLLMEngine.from_builder(build)
