"""Jump-forward (engine argument `jump_forward`, on by default): the text a constraint forces is output
without a draw per token, tokenised by the tokenizer and computed in the request's next step. Every finished
output still satisfies its constraint (serial, overlapped, held draws, chunked prefill, preemption, prefix
hits, n > 1); the forced tokens are output tokens whose stream adds up to the final text; max_tokens and stop
strings cut a forced run exactly; a request asking for logprobs draws every token; a forced-heavy schema
takes far fewer engine steps (`LLM.stats()["num_steps"]`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from asyncllm import LLM, RequestOutput, SamplingParams
from asyncllm.structured_output.mask_fill import JUMP_MAX_ROWS
from tests.fixtures.envs import serial_llm
from tests.structured.conftest import (
    CONSTRAINTS,
    ENGINE_ARGS,
    MAX_TOKENS,
    PERSON,
    check,
    constrained,
    overlapped_engine,
)

PROMPT = "The capital of France is Paris. The capital of Japan is Tokyo. " * 2


@pytest.fixture(scope="module")
def jumping(tiny_model: Path) -> Iterator[LLM]:
    llm = serial_llm(str(tiny_model), **ENGINE_ARGS)  # ASYNCLLM_JUMP_FORWARD=1: the default
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def drawing(tiny_model: Path) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as env:  # read when the engine is built
        env.setenv("ASYNCLLM_JUMP_FORWARD", "0")
        llm = serial_llm(str(tiny_model), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def _generate(llm: LLM, prompts: list[Any], params: list[SamplingParams]) -> tuple[list[RequestOutput], int]:
    """The outputs and the engine steps they took."""
    before = llm.stats()["num_steps"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, int(llm.stats()["num_steps"] - before)


@pytest.mark.slow
def test_forced_heavy_schema_takes_fewer_steps(jumping: LLM, drawing: LLM) -> None:
    params = [constrained("person", "t1", seed=i) for i in range(6)]
    prompts: list[Any] = [[5 + i, 6, 7] for i in range(6)]
    jumped, jump_steps = _generate(jumping, prompts, params)
    drawn, draw_steps = _generate(drawing, prompts, params)
    for out in [*jumped, *drawn]:
        assert out.finish_reason == "stop"
        check("person", out.text)
    # Every key and piece of punctuation of PERSON is forced: most of each output is (measured 36 against 138
    # steps for a similar mix).
    assert jump_steps < 0.6 * draw_steps, (jump_steps, draw_steps)


def test_steps_of_many_rows_draw_every_token(jumping: LLM, drawing: LLM) -> None:
    """Past JUMP_MAX_ROWS sampled rows a step takes no forced run (a run would make the next step a mixed one
    for everyone in it): the outputs are the drawing engine's, in as many steps; a few requests jump."""
    n = 2 * JUMP_MAX_ROWS
    params = [SamplingParams(json_schema=PERSON, seed=i, max_tokens=12) for i in range(n)]
    prompts: list[Any] = [[5 + i % 40, 6 + i // 40, 7] for i in range(n)]
    many, many_steps = _generate(jumping, prompts, params)
    drawn, draw_steps = _generate(drawing, prompts, params)
    assert [o.token_ids for o in many] == [o.token_ids for o in drawn]
    assert many_steps == draw_steps
    _, few_steps = _generate(jumping, prompts[:4], params[:4])
    assert few_steps < draw_steps


def test_every_constraint_holds_and_forced_tokens_spell_the_text(tiny_model: Path, jumping: LLM) -> None:
    names = [name for name in CONSTRAINTS for _ in range(2)]
    params = [constrained(name, "hot_top_k" if i % 2 else "greedy", seed=i) for i, name in enumerate(names)]
    outs = jumping.generate([[9, 10 + i] for i in range(len(names))], params, use_tqdm=False)
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    for name, out in zip(names, outs):
        assert out.finish_reason == "stop", name
        check(name, out.text)
        assert tokenizer.decode(out.token_ids, skip_special_tokens=True) == out.text


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13])
def test_max_tokens_cuts_a_forced_run_exactly(jumping: LLM, max_tokens: int) -> None:
    params = SamplingParams(json_schema=PERSON, seed=3, max_tokens=max_tokens)
    out = jumping.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert len(out.token_ids) == max_tokens
    assert out.finish_reason == "length"


def test_stop_string_inside_a_forced_run(jumping: LLM) -> None:
    # "age" is a key of PERSON's, output within the forced run that closes "name" and opens "age"'s value.
    params = SamplingParams(json_schema=PERSON, seed=4, max_tokens=MAX_TOKENS, stop=["age"])
    out = jumping.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert "name" in out.text and "age" not in out.text


def test_a_request_asking_for_logprobs_draws_every_token(jumping: LLM) -> None:
    params = SamplingParams(json_schema=PERSON, seed=5, max_tokens=MAX_TOKENS, logprobs=1)
    [out], steps = _generate(jumping, [[5, 6, 7]], [params])
    assert out.finish_reason == "stop"
    check("person", out.text)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert steps == len(out.token_ids)  # its prompt's step draws the first token, each step one more
    unread = SamplingParams(json_schema=PERSON, seed=5, max_tokens=MAX_TOKENS)
    [plain], plain_steps = _generate(jumping, [[5, 6, 7]], [unread])
    assert plain_steps < len(plain.token_ids)


async def _stream(engine: Any, prompt: Any, params: SamplingParams) -> tuple[list[int], str, Any]:
    chunks = [c async for c in engine.stream(prompt, params)]
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"hold_masked_draws": True},
        {"hold_masked_draws": True, "max_num_batched_tokens": 16, "max_num_seqs": 6},
        {"hold_masked_draws": True, "num_kv_blocks": 56},
    ],
    ids=["overlap", "held", "held-chunked", "held-preempted"],
)
@pytest.mark.slow
async def test_overlapped_paths_give_the_serial_tokens(tiny_model: Path, jumping: LLM, variant: dict[str, Any]) -> None:
    """Overlapped scheduling plans the next step before a run is known: that step's draw is the run's first
    token (its row allows it alone). The outputs are still serial scheduling's, token for token; the same
    prompts again hit the prefix cache; n > 1 samples jump each with its own matcher."""
    # Not dot_regex: xgrammar's `.` takes a newline, which its checker (Python's re) refuses.
    names = [name for name in [*CONSTRAINTS, "person", "scores"] if name != "dot_regex"]
    prompts: list[Any] = [PROMPT if i % 2 else [5 + i, 6, 7] for i in range(len(names))]
    params = [constrained(name, "t1", seed=50 + i) for i, name in enumerate(names)]
    want = jumping.generate(prompts, params, use_tqdm=False)
    samples = constrained("person", "t1", seed=9, n=3)
    want_samples = jumping.generate([PROMPT], samples, use_tqdm=False)[0].outputs
    engine = overlapped_engine(tiny_model, **{**ENGINE_ARGS, **variant})
    try:
        for _ in range(2):  # the second round: prefix-cache hits
            reads = (_stream(engine, p, sp) for p, sp in zip(prompts, params))
            got = await asyncio.wait_for(asyncio.gather(*reads, engine.generate(PROMPT, samples)), 120)
            for (tokens, text, reason), ref, name in zip(got[:-1], want, names):
                assert (tokens, text, reason) == (ref.token_ids, ref.text, ref.finish_reason), name
                check(name, text)
            for sample, ref_sample in zip(got[-1].outputs, want_samples, strict=True):
                assert (sample.token_ids, sample.text) == (ref_sample.token_ids, ref_sample.text)
                check("person", sample.text)
        assert engine.stats()["prefix_cache_hit_rate"] > 0
    finally:
        engine.shutdown()
