"""The async engine on the real tiny model (CPU): concurrent streams give exactly what offline `LLM.generate`
gives (greedy and seeded sampling), text included, and cancelled streams free their blocks."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncllm import LLM, AsyncLLMEngine, SamplingParams
from tests.async_engine.conftest import wait_drained

ENGINE_ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=512, seed=3)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(str(tiny_model), **ENGINE_ARGS)  # loads in its step thread; loop-independent
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_model), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def _requests(seed: int, n: int) -> tuple[list[Any], list[SamplingParams]]:
    rng = random.Random(seed)
    words = ["The capital", "Hello", "日本語", "emoji 😀", "def add(a, b):", "Zürich café", "Numbers 0123"]
    prompts: list[Any] = []
    params = []
    for i in range(n):
        prompts.append(rng.choice(words) if i % 2 else [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))])
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(10**6), max_tokens=12))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20)))
    return prompts, params


async def test_concurrent_streams_equal_offline_generate(engine: AsyncLLMEngine, llm: LLM) -> None:
    prompts, params = _requests(random.randrange(10**6), 24)
    expected = llm.generate(prompts, params, use_tqdm=False)
    streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]

    async def read(stream: Any) -> tuple[list[int], str, Any]:
        chunks = [c async for c in stream]
        return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]

    results = await asyncio.wait_for(asyncio.gather(*(read(s) for s in streams)), 60)
    for (tokens, text, last), want, stream in zip(results, expected, streams):
        assert tokens == want.token_ids
        assert text == want.text
        assert last.finish_reason == want.finish_reason
        assert stream.prompt_token_ids == tuple(want.prompt_token_ids)
        assert last.metrics.time_to_first_token <= last.metrics.e2e_latency
    await wait_drained(engine)


async def test_generate_matches_and_cancel_frees_blocks(engine: AsyncLLMEngine, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = await engine.generate("Hello world", params)
    want = llm.generate("Hello world", params, use_tqdm=False)[0]
    assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    long = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400)
    tasks = [asyncio.create_task(engine.generate([5, 6, 7 + i], long)) for i in range(8)]
    await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    stats = await wait_drained(engine, timeout=10)
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 512
