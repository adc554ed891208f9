"""`AsyncLLMEngine.embed`, `score` and `rerank` on a tiny Qwen3-Embedding (CPU): the same vectors as offline
`LLM.embed`, in-process and with the core in its own process; a cancelled call frees every block; the same
admission (`max_waiting_requests`), timeouts and refusals as generation requests."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncllm import (
    LLM,
    AsyncLLMEngine,
    EngineOverloadedError,
    InvalidRequestError,
    RequestTimeoutError,
    SamplingParams,
)
from tests.async_engine.conftest import wait_drained
from tests.fixtures.pooling_models import build_qwen3_embedding

ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_embedding(tmp_path_factory.mktemp("embedding") / "qwen3")


@pytest.fixture(scope="module")
def engine(path: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(str(path), **ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(path: Path) -> Iterator[LLM]:
    llm = LLM(str(path), **ARGS)
    yield llm
    llm.shutdown()


def _inputs(seed: int, n: int) -> list[Any]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, 380) for _ in range(rng.randrange(1, 120))] if i % 2 else f"text {i} " * rng.randrange(1, 9)
        for i in range(n)
    ]


async def test_embed_score_and_rerank_equal_offline(engine: AsyncLLMEngine, llm: LLM) -> None:
    inputs = _inputs(1, 16)
    got, want = await engine.embed(inputs, dimensions=32), llm.embed(inputs, dimensions=32)
    assert [g.num_prompt_tokens for g in got] == [w.num_prompt_tokens for w in want]
    for g, w in zip(got, want):
        assert max(abs(a - b) for a, b in zip(g.embedding, w.embedding)) < 1e-6
    calls = [engine.embed(x, prompt_name="query") for x in ["a", "bb", "ccc"]]  # concurrent calls
    for out, x in zip(await asyncio.gather(*calls), ["a", "bb", "ccc"]):
        assert out[0].embedding == pytest.approx(llm.embed(x, prompt_name="query")[0].embedding, abs=1e-6)
    docs = ["Hello world", "The capital of France is Paris.", "emoji 😀"]
    assert await engine.score("capital", docs) == pytest.approx(llm.score("capital", docs), abs=1e-6)
    assert await engine.rerank("capital", docs, top_n=2) == llm.rerank("capital", docs, top_n=2)
    await wait_drained(engine)


async def test_the_core_process_embeds_the_same(path: Path, llm: LLM) -> None:
    inputs = _inputs(2, 6)
    engine = AsyncLLMEngine(str(path), **ARGS, core_process=True)
    try:
        got = await engine.embed(inputs)
        await wait_drained(engine)
    finally:
        await engine.aclose()
    for g, w in zip(got, llm.embed(inputs)):
        assert g.embedding == pytest.approx(w.embedding, abs=1e-6)


async def test_a_cancelled_call_frees_every_request_and_block(engine: AsyncLLMEngine) -> None:
    for delay in (0.0, 0.005, 0.02):
        task = asyncio.ensure_future(engine.embed(_inputs(3, 200)))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await wait_drained(engine)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_admission_refuses_an_overload_and_leaves_nothing_behind(path: Path) -> None:
    engine = AsyncLLMEngine(str(path), **ARGS, max_waiting_requests=3)
    try:
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=3"):
            await engine.embed(_inputs(4, 8))
        await wait_drained(engine)
        assert engine.stats()["num_rejected"] == 1
        assert len(await engine.embed(_inputs(5, 3))) == 3  # within the bound: served
    finally:
        await engine.aclose()


async def test_timeouts_and_refusals(engine: AsyncLLMEngine) -> None:
    with pytest.raises(RequestTimeoutError):
        await engine.embed(_inputs(6, 4), timeout=1e-9)
    with pytest.raises(
        InvalidRequestError, match="add_request\\(\\) generates text, but this engine serves task='embed'"
    ):
        engine.add_request("hi", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="chat\\(\\) generates text"):
        engine.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="top_n=0 is invalid"):
        await engine.rerank("q", ["d"], top_n=0)
    with pytest.raises(InvalidRequestError, match="priority='high' is invalid"):
        await engine.embed("x", priority="high")  # type: ignore[arg-type]
    await wait_drained(engine)
