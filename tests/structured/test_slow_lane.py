"""A constraint that is slow to follow costs its own requests, not the step (issue 39): the tiny model, an enum
of 10,000 eight-letter words (xgrammar cannot make it an automaton: a few milliseconds a row at its widest
states, against microseconds for an ordinary schema), ASYNCLLM_GRAMMAR_SLOW_FILL_MS low enough that any
machine finds it slow. Its requests' matchers move to the slow lane and their draws sit out while their masks
are filled there (`ModelRunnerOutput.deferred`, read off the engine's executor); every output still satisfies
the constraint, the plain requests beside them run their full length, and a seeded request draws what it
draws with the lane off (`ASYNCLLM_GRAMMAR_SLOW_FILL_MS=off`; both drawing every token,
`ASYNCLLM_JUMP_FORWARD=0`). Overlapped scheduling (as on a GPU) too; and with the grammar process
(`ASYNCLLM_GRAMMAR_PROCESS=on`), which times its own rows and reports the constraint slow, so that the
requests after the first go to the lane."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncllm import AsyncLLMEngine, SamplingParams
from asyncllm.build import build_engine
from asyncllm.config import EngineConfig
from asyncllm.step import ModelRunnerOutput, RuntimeInfo, SchedulerOutput, StepResult
from tests.async_engine.conftest import wait_drained
from tests.structured.conftest import ENGINE_ARGS, OverlappedExecutor

_rng = random.Random(0)
WORDS = sorted({"".join(_rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) for _ in range(10_000)})
SCHEMA = {"type": "array", "items": {"enum": WORDS}, "minItems": 2, "maxItems": 2}  # two slow states a request


class _Recorded:
    def __init__(self, inner: StepResult, sink: list[list[int]]) -> None:
        self._inner, self._sink = inner, sink

    def done(self) -> bool:
        return self._inner.done()

    def start(self) -> None:
        self._inner.start()

    def result(self) -> ModelRunnerOutput:
        output = self._inner.result()
        if output.deferred:
            self._sink.append(output.deferred)
        return output


class RecordingExecutor:
    """The engine's own executor; each step's deferred rows are kept in `deferred`."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.grammar, self.deferred = inner, inner.grammar, []

    @property
    def runtime(self) -> RuntimeInfo:
        runtime: RuntimeInfo = self.inner.runtime
        return runtime

    def submit(self, scheduled: SchedulerOutput) -> StepResult:
        return _Recorded(self.inner.submit(scheduled), self.deferred)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def watch_failure(self, callback: Callable[[BaseException], None]) -> None:
        self.inner.watch_failure(callback)


def _engine(path: Path, overlapped: bool) -> tuple[AsyncLLMEngine, RecordingExecutor]:
    config = EngineConfig.from_kwargs(str(path), **ENGINE_ARGS).resolved(streaming=True)
    made: list[RecordingExecutor] = []

    def build() -> Any:
        built = build_engine(config, time.monotonic)
        made.append(RecordingExecutor(built.core.executor))
        built.core.executor = OverlappedExecutor(made[0]) if overlapped else made[0]
        return built

    return AsyncLLMEngine.from_builder(build), made[0]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(json_schema=SCHEMA, temperature=1.0, seed=seed, max_tokens=60)


async def _serve(engine: AsyncLLMEngine) -> tuple[list[str], list[int]]:
    """Six requests with the constraint beside two plain ones, once the constraint is known slow: the
    constrained texts and the plain requests' token counts."""
    await engine.generate("Hi", _params(99))  # its first request finds it slow (and compiles it)
    constrained = [engine.generate(f"List {i}", _params(i)) for i in range(6)]
    plain = [engine.generate([5, 6, 7 + i], SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(2)]
    outs = await asyncio.wait_for(asyncio.gather(*constrained, *plain), 240)
    await wait_drained(engine)
    return [o.text for o in outs[:6]], [len(o.token_ids) for o in outs[6:]]


def _check(texts: list[str]) -> None:
    for text in texts:
        values = json.loads(text)
        assert len(values) == 2 and all(v in WORDS for v in values), text


@pytest.mark.slow  # two compiles of the enum (~1 s each)
@pytest.mark.parametrize("variant", ["serial", "overlapped", "process"])
async def test_a_slow_constraint_sits_out_and_still_holds(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    overlapped = variant == "overlapped"
    if variant == "process":
        monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "on")  # the first request's matcher goes there
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_SLOW_FILL_MS", "0.2")  # read when the engine is built
    # The lane's requests draw every token: so does the twin (a forced run's text is the same, its tokens and
    # so the draws after them may not be).
    monkeypatch.setenv("ASYNCLLM_JUMP_FORWARD", "0")
    engine, executor = _engine(tiny_model, overlapped)
    try:
        texts, plain = await _serve(engine)
    finally:
        engine.shutdown()
    _check(texts)
    assert plain == [40, 40]
    assert executor.deferred, "no draw sat out"
    if variant != "serial":
        return
    monkeypatch.delenv("ASYNCLLM_GRAMMAR_PROCESS", raising=False)
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_SLOW_FILL_MS", "off")
    twin, twin_executor = _engine(tiny_model, False)
    try:
        twin_texts, _ = await _serve(twin)
    finally:
        twin.shutdown()
    assert not twin_executor.deferred
    assert texts == twin_texts  # a draw that sits out takes nothing: the same seeded draws
