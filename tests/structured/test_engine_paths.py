"""Constrained requests through every path a step can take, on the async engine: overlapped scheduling (the
step's mask waits for the previous step's tokens), with the draw launched at once or held until the next
submit as on CUDA, gives the tokens serial scheduling gives; chunked prefill, preemption and prefix-cache
hits change nothing; streamed deltas add up to the final text; a cancelled constrained stream frees every
block; a row its constraint leaves empty fails its request without emitting the token drawn there."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncllm import LLM, AsyncLLMEngine, InvalidRequestError, SamplingParams
from tests.async_engine.conftest import wait_drained
from tests.fixtures.envs import serial_llm
from tests.structured.conftest import CONSTRAINTS, ENGINE_ARGS, check, constrained, overlapped_engine

LONG_PROMPT = "The capital of France is Paris. The capital of Japan is Tokyo. Hello world! " * 2


def _workload() -> tuple[list[Any], list[SamplingParams], list[str | None]]:
    """Constrained requests of every kind and draw, mixed with unconstrained ones; the constraint's name
    (None: unconstrained) of each."""
    prompts: list[Any] = []
    params: list[SamplingParams] = []
    names: list[str | None] = []
    draws = ["greedy", "t1", "hot_top_k", "top_p_min_p"]
    for i, name in enumerate([*CONSTRAINTS, "person", "scores"]):
        prompts.append(LONG_PROMPT if i % 3 == 0 else [5 + i, 6, 7, 8 + i])
        params.append(constrained(name, draws[i % len(draws)], seed=100 + i))
        names.append(name)
        prompts.append("Hello" if i % 2 else [9, 10 + i])
        params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=6 + i))
        names.append(None)
    return prompts, params, names


async def _run(
    engine: AsyncLLMEngine, prompts: list[Any], params: list[SamplingParams]
) -> list[tuple[list[int], str, Any]]:
    async def read(prompt: Any, sp: SamplingParams) -> tuple[list[int], str, Any]:
        chunks = [c async for c in engine.stream(prompt, sp)]
        return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason

    return await asyncio.wait_for(asyncio.gather(*(read(p, sp) for p, sp in zip(prompts, params))), 120)


@pytest.fixture(scope="module")
def serial(tiny_model: Path) -> Iterator[LLM]:
    llm = serial_llm(str(tiny_model), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(
    "variant",
    [
        {},  # overlapped, plenty of room
        {"max_num_batched_tokens": 16, "max_num_seqs": 6},  # chunked prefill, small batches
        {"num_kv_blocks": 56},  # preemption (and the prefix cache on resume)
        # each constrained draw held until the next submit, as on CUDA: with every path above
        {"hold_masked_draws": True},
        {"hold_masked_draws": True, "max_num_batched_tokens": 16, "max_num_seqs": 6},
        {"hold_masked_draws": True, "num_kv_blocks": 56},
    ],
    ids=["overlap", "chunked", "preempted", "held", "held-chunked", "held-preempted"],
)
async def test_overlapped_engine_gives_serial_tokens(tiny_model: Path, serial: LLM, variant: dict[str, Any]) -> None:
    prompts, params, names = _workload()
    want = serial.generate(prompts, params, use_tqdm=False)
    engine = overlapped_engine(tiny_model, **{**ENGINE_ARGS, **variant})
    try:
        got = await _run(engine, prompts, params)
        for (tokens, text, reason), ref, name in zip(got, want, names):
            assert (tokens, text, reason) == (ref.token_ids, ref.text, ref.finish_reason), name
            if name is not None:
                assert reason == "stop"
                check(name, text)
        # the same constrained prompts again: prefix-cache hits (the matcher starts at the prompt's end)
        again = await _run(engine, prompts[:4], params[:4])
        assert [g[:2] for g in again] == [(r.token_ids, r.text) for r in want[:4]]
        stats = await wait_drained(engine, timeout=10)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        if "num_kv_blocks" in variant:
            assert stats["num_preemptions"] > 0, "the variant must preempt"
        assert stats["prefix_cache_hit_rate"] > 0
    finally:
        engine.shutdown()


async def test_streamed_deltas_add_up_and_cancel_frees_blocks(tiny_model: Path) -> None:
    engine = AsyncLLMEngine(str(tiny_model), **ENGINE_ARGS)
    try:
        params = constrained("person", "t1", seed=3)
        chunks = [c async for c in engine.stream("Hello", params)]
        whole = await engine.generate("Hello", params)
        assert "".join(c.text for c in chunks) == whole.text and len(chunks) > 3
        assert [t for c in chunks for t in c.token_ids] == whole.token_ids
        check("person", whole.text)
        # Cancel constrained streams mid-flight (json_object runs long on a random model).
        endless = SamplingParams(json_object=True, temperature=1.0, seed=1)  # up to max_model_len
        tasks = [asyncio.create_task(engine.generate([5, 6, 7 + i], endless)) for i in range(4)]
        await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        stats = await wait_drained(engine, timeout=10)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        again = await engine.generate("Hello", params)  # the engine carries on, with the same result
        assert again.text == whole.text
    finally:
        engine.shutdown()


async def test_held_draw_fails_an_impossible_row_without_emitting_its_token(tiny_model: Path) -> None:
    """A surrogate has no UTF-8 form: after its lead byte (a token both the grammar and UTF-8 allow so far)
    the row's mask is empty, the draw takes token 0, and reading the step refuses it: the stream ends with
    the error naming the field, and token 0 is never emitted."""
    engine = overlapped_engine(tiny_model, hold_masked_draws=True, **ENGINE_ARGS)
    try:
        impossible = SamplingParams(grammar=r"root ::= [\ud800-\udfff]", max_tokens=8)
        chunks = []
        with pytest.raises(InvalidRequestError, match=r"SamplingParams\.grammar: no token"):
            async for chunk in engine.stream([5, 6, 7], impossible):
                chunks.append(chunk)
        tokens = [t for c in chunks for t in c.token_ids]
        assert 0 not in tokens and len(tokens) <= 1
        neighbour = await engine.generate([5, 6, 7], constrained("choice", "t1", seed=2))
        check("choice", neighbour.text)
        stats = await wait_drained(engine, timeout=10)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        engine.shutdown()
