"""Streams through `AsyncLLMEngine` against a fake core: results equal the core driven offline, chunk texts
concatenate to the final text (multi-byte characters included), and the request API behaves as documented."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from asyncllm import EngineDeadError, InvalidRequestError, SamplingParams, StreamOutput
from asyncllm.async_engine.engine import AsyncLLMEngine
from tests.async_engine.conftest import EngineFactory, wait_drained
from tests.fixtures.fake_core import fake_built, offline_run

_PROMPT_LEN = 5


async def _collect(stream: object) -> list[StreamOutput]:
    return [chunk async for chunk in stream]  # type: ignore[attr-defined]


def _random_requests(rng: random.Random, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[rng.randrange(1, 384) for _ in range(rng.randrange(1, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 48)) for _ in range(n)]
    return prompts, params


@pytest.mark.core_process
async def test_200_concurrent_streams_equal_offline(make_engine: EngineFactory, bpe_tokenizer: object) -> None:
    rng = random.Random()
    prompts, params = _random_requests(rng, 200)
    expected = offline_run(fake_built(bpe_tokenizer), prompts, params)
    engine, _ = make_engine()
    streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams)), 20)
    for chunks, (tokens, text), sp in zip(results, expected, params):
        assert [c.token_ids for c in chunks if not c.token_ids] == [], "no empty chunks"
        assert [t for c in chunks for t in c.token_ids] == tokens
        assert "".join(c.text for c in chunks) == text
        assert all(c.finish_reason is None and c.metrics is None for c in chunks[:-1])
        assert chunks[-1].finish_reason == "length" and len(tokens) == sp.max_tokens
    stats = await wait_drained(engine)
    assert stats["num_running"] == 0


async def test_multibyte_text_split_across_tokens_concatenates_exactly(
    make_engine: EngineFactory, bpe_tokenizer: object
) -> None:
    """A scripted model emits byte-level tokens of CJK and emoji text: characters span several tokens."""
    target = "日本語のテキスト 中文字符 한국어 😀🎉🚀 café"
    ids = bpe_tokenizer.encode(target).ids  # type: ignore[attr-defined]
    assert len(ids) > 10
    # one token per step, one character often needing several: many deltas end mid-character
    engine, _ = make_engine(next_token=lambda seq: ids[(len(seq) - _PROMPT_LEN) % len(ids)])
    rng = random.Random()
    letters = "abcdefghijklmnopqrstuvwxyz"
    # ASCII prompts: the detokenizer is primed with the prompt, which must not end mid-character
    streams = [
        engine.add_request(
            [bpe_tokenizer.token_to_id(rng.choice(letters)) for _ in range(_PROMPT_LEN)],  # type: ignore[attr-defined]
            SamplingParams(max_tokens=n),
        )
        for n in (len(ids), 2 * len(ids), 3 * len(ids) - 1)
    ]
    for stream, chunks in zip(streams, await asyncio.gather(*(_collect(s) for s in streams))):
        text = "".join(c.text for c in chunks)
        n = len([t for c in chunks for t in c.token_ids])
        assert text == bpe_tokenizer.decode([ids[i % len(ids)] for i in range(n)])  # type: ignore[attr-defined]
        assert target in text and "\ufffd" not in text[: len(target)]
        assert stream.finished


@pytest.mark.core_process
async def test_generate_returns_whole_result_with_metrics(make_engine: EngineFactory) -> None:
    engine, built = make_engine()
    out = await engine.generate("Hello world", SamplingParams(max_tokens=17), request_id="r1")
    assert out.request_id == "r1"
    assert out.prompt_token_ids == built.input_processor.tokenize("Hello world")
    assert len(out.token_ids) == 17 and out.finish_reason == "length"
    m = out.metrics
    assert m is not None and m.num_generated_tokens == 17 and m.num_prompt_tokens == len(out.prompt_token_ids)
    assert m.time_to_first_token is not None and 0.0 <= m.time_to_first_token <= m.e2e_latency < 5.0  # type: ignore[operator]


async def test_stop_string_chunks_never_leak_the_stop(make_engine: EngineFactory, bpe_tokenizer: object) -> None:
    ids = bpe_tokenizer.encode("alpha beta STOP gamma").ids  # type: ignore[attr-defined]
    engine, _ = make_engine(next_token=lambda seq: ids[(len(seq) - _PROMPT_LEN) % len(ids)])
    chunks = await _collect(engine.stream([7] * _PROMPT_LEN, SamplingParams(max_tokens=50, stop="STOP")))
    assert "".join(c.text for c in chunks) == "alpha beta "
    assert chunks[-1].finish_reason == "stop"


async def test_generated_ids_are_unique_and_caller_ids_kept(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    streams = [engine.add_request([5, 6], SamplingParams(max_tokens=2)) for _ in range(50)]
    assert len({s.request_id for s in streams}) == 50
    named = engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="mine")
    assert named.request_id == "mine"
    for s in [*streams, named]:
        assert all(c.request_id == s.request_id for c in await _collect(s))


@pytest.mark.core_process
async def test_duplicate_live_id_raises_at_once_and_is_reusable_after(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(step_delay=0.002)
    first = engine.add_request([3, 4, 5], SamplingParams(max_tokens=30), request_id="dup")
    with pytest.raises(InvalidRequestError, match="already live"):
        engine.add_request([3, 4, 5], SamplingParams(max_tokens=3), request_id="dup")
    assert len(await _collect(first)) >= 1  # the first one carries on untouched
    await wait_drained(engine)
    again = await engine.generate([3, 4, 5], SamplingParams(max_tokens=3), request_id="dup")
    assert again.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "empty"),
        ([], None, "empty"),
        ([1, 999], None, "outside the vocabulary"),
        (list(range(1, 300)), None, "max_model_len"),
        ([1, 2], "greedy", "SamplingParams"),
    ],
)
async def test_invalid_request_raises_at_once_and_leaves_nothing(
    make_engine: EngineFactory, prompt: object, params: object, match: str
) -> None:
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)  # type: ignore[arg-type]
    assert engine.num_live_requests == 0
    out = await engine.generate([1, 2], SamplingParams(max_tokens=3))  # the engine carries on
    assert len(out.token_ids) == 3
    await wait_drained(engine)


@pytest.mark.parametrize("bad_id", ["", 17])
async def test_bad_request_id_rejected(make_engine: EngineFactory, bad_id: object) -> None:
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request([1], request_id=bad_id)  # type: ignore[arg-type]


async def test_token_id_engine_without_tokenizer(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(text=False)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.add_request("text needs a tokenizer")
    out = await engine.generate([9, 8, 7], SamplingParams(max_tokens=6))
    assert len(out.token_ids) == 6 and out.text == ""


def test_add_request_outside_a_loop_says_why(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    with pytest.raises(RuntimeError, match="running event loop"):
        engine.add_request([1, 2])


@pytest.mark.core_process
async def test_stats_snapshot_and_health(make_engine: EngineFactory) -> None:
    engine, built = make_engine(step_delay=0.01)
    await engine.check_health()
    streams = [engine.add_request([4, 4, 4], SamplingParams(max_tokens=40)) for _ in range(4)]
    # Read while steps run (40 of 10 ms): a published snapshot, not a queued query. Polled, not read after a
    # fixed sleep: on a loaded machine (or through a core process) no step had published the four yet.
    deadline = time.monotonic() + 5
    while (stats := engine.stats()).get("num_running", 0) + stats.get("num_waiting", 0) != 4:
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.005)
    assert set(stats) >= {"num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "prefix_cache_hit_rate"}
    assert stats["num_running"] + stats["num_waiting"] == 4
    assert stats["num_free_blocks"] < stats["num_total_blocks"] == built.runtime.num_kv_blocks
    for s in streams:
        s.close()
    await wait_drained(engine)


async def test_async_with_shuts_down(bpe_tokenizer: object) -> None:
    built = fake_built(bpe_tokenizer)
    async with AsyncLLMEngine.from_builder(lambda: built) as engine:
        assert engine.is_running
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
    assert not engine.is_running and built.executor.is_shut_down
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.add_request([1, 2, 3])
    with pytest.raises(EngineDeadError):
        await engine.check_health()
