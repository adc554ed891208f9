"""A pool of two replicas on the tiny Qwen3 checkpoint behaves as one engine: the same outputs for seeded
streams (text and token prompts, n samples, chat), a shared prefix kept on one replica with the single
engine's hit rate, every block free after a storm of cancellations, and the same from trio."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncllm import AsyncLLMEngine, SamplingParams
from tests.ray.conftest import ENGINE_ARGS, wait_idle


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[AsyncLLMEngine]:
    """The single engine the pool must equal."""
    engine = AsyncLLMEngine(str(tiny_model), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def _requests(n: int, seed: int) -> tuple[list[Any], list[SamplingParams]]:
    rng = random.Random(seed)
    words = ["Hello world", "日本語のテキスト", "emoji 😀🎉", "def add(a, b):", "The quick brown fox"]
    prompts: list[Any] = [
        rng.choice(words) if i % 3 == 0 else [rng.randrange(1, 200) for _ in range(rng.randrange(1, 24))]
        for i in range(n)
    ]
    params = [
        SamplingParams(temperature=rng.choice([0.0, 0.8, 1.2]), top_p=0.9, seed=i, max_tokens=rng.randrange(1, 12))
        for i in range(n)
    ]
    return prompts, params


async def _streams(engine: AsyncLLMEngine, prompts: list[Any], params: list[SamplingParams]) -> list[Any]:
    async def one(prompt: Any, sp: SamplingParams) -> tuple[list[int], str, str | None]:
        chunks = [c async for c in engine.stream(prompt, sp)]
        return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason

    return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))


async def test_two_replicas_give_what_one_engine_gives(tiny_pool: Any, engine: AsyncLLMEngine) -> None:
    prompts, params = _requests(200, seed=1)
    before = [r["num_steps"] for r in tiny_pool.replica_stats()]
    got = await _streams(tiny_pool, prompts, params)
    assert got == await _streams(engine, prompts, params)
    after = [r["num_steps"] for r in await asyncio.to_thread(wait_idle, tiny_pool)]
    assert all(a > b for a, b in zip(after, before)), "a replica got no work"


async def test_n_samples_and_chat_run_unchanged(tiny_pool: Any, engine: AsyncLLMEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6)
    got, want = await tiny_pool.generate("Hello", params), await engine.generate("Hello", params)
    samples = [[(o.index, o.token_ids, o.text) for o in out.outputs] for out in (got, want)]
    assert samples[0] == samples[1] and len(samples[0]) == 3
    messages = [{"role": "user", "content": "Hi there"}]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    got_chat = [c.text async for c in tiny_pool.chat(messages, greedy)]
    assert got_chat and "".join(got_chat) == "".join([c.text async for c in engine.chat(messages, greedy)])


async def test_a_shared_prefix_goes_to_one_replica_and_keeps_its_hits(tiny_pool: Any, engine: AsyncLLMEngine) -> None:
    """W3-like: requests sharing long prefixes. Each prefix's requests all land on one replica, and the pool's
    hit rate over them is the single engine's."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(200, 380) for _ in range(12)] for _ in range(6)]  # 3 full blocks each
    params = SamplingParams(temperature=0, max_tokens=2)

    def wave(first: bool) -> list[list[int]]:
        return [[*p, 100 + i, 150 + k] for i, p in enumerate(prefixes) for k in ((0,) if first else range(1, 5))]

    async def run(target: Any) -> tuple[float, float]:
        stats = target.stats()
        q, h = stats["prefix_cache_queried_tokens"], stats["prefix_cache_hit_tokens"]
        for first in (True, False):  # each prefix's first request computes it, then the rest share it
            await asyncio.gather(*(target.generate(p, params) for p in wave(first)))
        stats = target.stats()
        return stats["prefix_cache_queried_tokens"] - q, stats["prefix_cache_hit_tokens"] - h

    await asyncio.to_thread(wait_idle, tiny_pool)
    queried, hits = await run(tiny_pool)
    want_queried, want_hits = await run(engine)
    assert (queried, hits) == (want_queried, want_hits) and hits / queried > 0.6

    before = [r["prefix_cache_queried_tokens"] for r in tiny_pool.replica_stats()]
    shared = [rng.randrange(200, 380) for _ in range(8)]
    await asyncio.gather(*(tiny_pool.generate([*shared, 1, 2, i], params) for i in range(10)))
    rows = await asyncio.to_thread(wait_idle, tiny_pool)
    grew = [r["prefix_cache_queried_tokens"] - b for r, b in zip(rows, before)]
    assert sorted(grew) == [0, 10 * 11], grew  # all ten on one replica


async def test_a_cancellation_storm_leaves_every_block_free(tiny_pool: Any) -> None:
    rng = random.Random(3)
    unbounded = SamplingParams(max_tokens=400, ignore_eos=True)

    async def reader(i: int) -> None:
        stream = tiny_pool.stream([rng.randrange(1, 200) for _ in range(1 + i % 9)], unbounded)
        async for _ in stream:
            await asyncio.sleep(0)

    async def storm() -> None:
        tasks = [asyncio.create_task(reader(i)) for i in range(80)]
        for task in rng.sample(tasks, len(tasks)):  # cancelled in random order, at random points of their streams
            await asyncio.sleep(rng.random() * 0.01)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert all(t.cancelled() for t in tasks)

    steps = [r["num_steps"] for r in tiny_pool.replica_stats()]
    await storm()
    early = tiny_pool.stream([5, 6, 7], unbounded)  # and one closed after its first chunk
    async for _ in early:
        break
    await early.aclose()
    rows = await asyncio.to_thread(wait_idle, tiny_pool)
    assert all(r["ready"] and r["num_free_blocks"] == r["num_total_blocks"] for r in rows), rows
    ran = [r["num_steps"] - s for r, s in zip(rows, steps)]
    assert max(ran) < 390, ran  # they were aborted: none ran its 400 tokens


def test_streams_and_cancellation_from_trio(tiny_pool: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=5)

    async def scenario() -> None:
        chunks = [c async for c in tiny_pool.stream([3, 4, 5, 6], params)]
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 5
        with anyio.move_on_after(0.2) as scope:
            async for _ in tiny_pool.stream([7, 8], SamplingParams(max_tokens=400, ignore_eos=True)):
                pass
        assert scope.cancelled_caught

    anyio.run(scenario, backend="trio")
    wait_idle(tiny_pool)
