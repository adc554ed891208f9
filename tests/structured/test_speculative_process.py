"""Structured output with speculative decoding where the matchers live in the grammar process
(`ASYNCLLM_GRAMMAR_PROCESS=on`, issue 41): the process fills each drafted row after the drafts before it
(a DRAFTS message: it accepts them, fills a row after each, rolls back) and takes each verified step's accepted
tokens before its last, so its matchers end advanced by exactly the accepted tokens. JSON schemas, regexes, a
choice and an EBNF grammar, greedy and seeded, with jump-forward on and off (the process's matchers never
jump), n-gram drafts and replayed ones (right, and wrong every third position), give exactly the tokens of the
same engine without speculation; serially, and overlapped with held draws as on CUDA.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from asyncllm import LLM, AsyncLLMEngine, RequestOutput, SamplingParams
from asyncllm.build import build_engine
from asyncllm.config import EngineConfig
from tests.async_engine.conftest import wait_drained
from tests.fixtures.spec_drafters import Replay, drafting_with
from tests.structured.conftest import ENGINE_ARGS, OverlappedExecutor, check, constrained, overlapped_engine
from tests.structured.test_grammar_process import grammar_processes
from tests.structured.test_slow_lane import WORDS, RecordingExecutor
from tests.structured.test_slow_lane import _params as lane_params

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3, 4, 3, 4, 3, 4, 3]]
NAMES = ["person", "scores", "regex", "choice", "grammar"]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# Greedy requests on PROMPTS, seeded ones on these (the same repeats, other ids): no seeded request's tokens are a
# prefix of a greedy one's, so a replayed draft is always the request's own continuation.
SEEDED_PROMPTS = [[t + 20 for t in p] for p in PROMPTS]
ALL_PROMPTS = PROMPTS * len(NAMES) + SEEDED_PROMPTS * len(NAMES)


def _params() -> list[SamplingParams]:
    """Every name on every prompt, greedy (on PROMPTS) then seeded (on SEEDED_PROMPTS), as in ALL_PROMPTS."""
    return [
        constrained(name, draw, seed=11 * i + j)
        for draw in ("greedy", "t1")
        for i, name in enumerate(NAMES)
        for j in range(len(PROMPTS))
    ]


def _generate(model: Path, params: list[SamplingParams], spec: dict | None, drafter: Any = None):
    with drafting_with(drafter):
        llm = LLM(str(model), speculative_config=spec, **ENGINE_ARGS)
    try:
        outs = llm.generate(ALL_PROMPTS, params, use_tqdm=False)
        # Started with the engine (by its starter thread), so every constrained matcher went there; counted after
        # the run, as tests/structured/test_grammar_process.py does, polled for a loaded machine.
        deadline = time.monotonic() + 30
        while len(grammar_processes()) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(grammar_processes()) == 1
        return outs, llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.slow  # an engine and its grammar process a run, four runs a case
@pytest.mark.parametrize("jump", [True, False], ids=["jump-forward", "drawn"])
def test_drafts_through_the_grammar_process_give_the_tokens_without_speculation(
    tiny_model: Path, jump: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy and seeded requests in each run."""
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "on")
    monkeypatch.setenv("ASYNCLLM_JUMP_FORWARD", str(int(jump)))
    params = _params()
    ref, _ = _generate(tiny_model, params, None)
    want = [o.outputs[0].token_ids for o in ref]
    for i, out in enumerate(ref):
        check(NAMES[i % len(PROMPTS * len(NAMES)) // len(PROMPTS)], out.outputs[0].text)
    sequences = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in ref]
    for drafter in [None, Replay(sequences, 4, wrong=0), Replay(sequences, 4, wrong=3)]:
        outs, stats = _generate(tiny_model, params, SPEC, drafter)
        assert [o.outputs[0].token_ids for o in outs] == want, getattr(drafter, "wrong", "ngram")
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
        assert stats["spec_draft_tokens"] > 0
        if drafter is not None:
            half = len(PROMPTS * len(NAMES))  # the first three names' requests, greedy and seeded, were drafted for
            assert {f"llm-{i}" for i in [*range(9), *range(half, half + 9)]} <= drafter.drafted, drafter.drafted
            assert stats["spec_accepted_tokens"] > 0
            if drafter.wrong == 0:  # every draft right and none forced (the process draws every token): all taken
                assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.slow
async def test_drafts_through_the_grammar_process_overlapped_with_held_draws(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on CUDA: other requests' steps overlap (a drafted request's are serial), each constrained draw held
    until the next submit; the requests' samples (n=2) draft too."""
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "on")
    params = [constrained(name, "t1", seed=3 + i, n=2) for i, name in enumerate(NAMES)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(NAMES))]
    ref = _sync(tiny_model, prompts, params)
    engine = overlapped_engine(tiny_model, hold_masked_draws=True, speculative_config=SPEC, **ENGINE_ARGS)
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params))), 120)
        stats = await wait_drained(engine, timeout=10)
    finally:
        engine.shutdown()
    for name, out, want in zip(NAMES, outs, ref):
        assert [o.token_ids for o in out.outputs] == want, name
        for o in out.outputs:
            check(name, o.text)
    assert stats["spec_draft_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def _sync(model: Path, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    """Each request's samples' tokens from the same engine without speculation (serial)."""
    llm = LLM(str(model), **ENGINE_ARGS)
    try:
        return [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------------------------- the slow lane
def _lane_engine(path: Path, overlapped: bool, spec: dict | None, drafter: Any) -> tuple[Any, RecordingExecutor]:
    """An engine whose executor records the steps' deferred rows; `drafter` (if not None) drafts for it."""
    config = EngineConfig.from_kwargs(str(path), speculative_config=spec, **ENGINE_ARGS).resolved(streaming=True)
    made: list[RecordingExecutor] = []

    def build() -> Any:
        with drafting_with(drafter):  # (in the step thread: the patch is the module's, seen by every thread)
            built = build_engine(config, time.monotonic)
        made.append(RecordingExecutor(built.core.executor))
        built.core.executor = OverlappedExecutor(made[0]) if overlapped else made[0]
        return built

    return AsyncLLMEngine.from_builder(build), made[0]


LANE_PROMPTS = [[9, 8, 7, 6]] + [[5, 6, 7 + i] for i in range(6)] + [[5, 6, 20 + i] for i in range(2)]
PLAIN = 80  # the plain requests' tokens, one a step (never drafted): they outlast the constrained ones


async def _serve_lane(engine: AsyncLLMEngine) -> tuple[list[RequestOutput], dict[str, Any]]:
    """The slow constraint's first request (found slow, compiled), then six more beside two plain requests."""
    first = await engine.generate(LANE_PROMPTS[0], lane_params(99))
    constrained = [engine.generate(p, lane_params(i)) for i, p in enumerate(LANE_PROMPTS[1:7])]
    plain = [engine.generate(p, SamplingParams(max_tokens=PLAIN, ignore_eos=True)) for p in LANE_PROMPTS[7:]]
    outs = await asyncio.wait_for(asyncio.gather(*constrained, *plain), 240)
    return [first, *outs], await wait_drained(engine, timeout=10)


@pytest.fixture(scope="module")
def lane_twin(tiny_model: Path) -> list[RequestOutput]:
    """The lane's requests without the lane and without speculation, drawing every token (serial)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ASYNCLLM_GRAMMAR_SLOW_FILL_MS", "off")
        env.setenv("ASYNCLLM_JUMP_FORWARD", "0")
        engine, executor = _lane_engine(tiny_model, False, None, None)
    try:
        outs, _ = asyncio.run(_serve_lane(engine))
    finally:
        engine.shutdown()
    assert not executor.deferred
    return outs


@pytest.mark.slow  # the enum's compiles (~1 s each)
@pytest.mark.parametrize("variant", ["serial", "overlapped", "process"])
async def test_a_slow_constraint_sits_out_in_a_speculating_engine(
    tiny_model: Path, lane_twin: list[RequestOutput], monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """Issue 39 with speculation: the slow constraint's requests (the first one's matcher in the grammar
    process, for "process") draft (replayed drafts, wrong every third position) and their draws sit out while
    their masks are filled in the slow lane (their drafted rows too: a request whose rows are not filled by its
    draw has its drafts unverified that step); the plain requests run their full length; every request gives
    the tokens of the engine with neither the lane nor speculation. Overlapped, a drafted request's steps run
    serially while the others' overlap, so its lane has a whole step to fill its rows: those may never sit out."""
    if variant == "process":
        monkeypatch.setenv("ASYNCLLM_GRAMMAR_PROCESS", "on")
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_SLOW_FILL_MS", "0.2")
    monkeypatch.setenv("ASYNCLLM_JUMP_FORWARD", "0")
    drafter = Replay([(o.prompt_token_ids, o.token_ids) for o in lane_twin[:7]], 4, wrong=3)
    engine, executor = _lane_engine(tiny_model, variant == "overlapped", SPEC, drafter)
    try:
        outs, stats = await _serve_lane(engine)
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in lane_twin]
    for out in outs[:7]:
        values = json.loads(out.text)
        assert len(values) == 2 and all(v in WORDS for v in values), out.text
    assert [len(o.token_ids) for o in outs[7:]] == [PLAIN, PLAIN]
    if variant != "overlapped":  # there a drafted request's steps are serial: its lane has a step to fill
        assert executor.deferred, "no draw sat out"
    assert len(drafter.drafted) == 7, drafter.drafted  # every constrained request drafted
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
