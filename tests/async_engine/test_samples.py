"""Several samples per prompt (`SamplingParams(n=...)`) through the async engine and `LLM`, on the tiny real
model (CPU): each sample equals an independent request seeded s + i token for token while the samples share
the prompt's blocks (measured through `stats()`), streams label chunks by sample and end after the last
one, and every way of ending the request frees every block."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncllm import LLM, AsyncLLMEngine, SamplingParams, StreamOutput
from asyncllm.errors import InvalidRequestError
from tests.async_engine.conftest import wait_drained

# No prefix cache: whatever the samples share, they share through the sample group alone.
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, seed=3, enable_prefix_caching=False
)
PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks shared, each sample computes the last token


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(str(tiny_model), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


def _alone(params: SamplingParams, i: int) -> SamplingParams:
    """Sample i of `params` as a request of its own: n=1, seed s + i."""
    assert params.seed is not None
    return dataclasses.replace(params, n=1, seed=params.seed + i)


async def _by_sample(stream: Any) -> tuple[dict[int, list[StreamOutput]], list[StreamOutput]]:
    chunks = [c async for c in stream]
    by: dict[int, list[StreamOutput]] = {}
    for c in chunks:
        by.setdefault(c.index, []).append(c)
    return by, chunks


async def test_samples_equal_independent_seeded_requests(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(n=4, seed=11, temperature=0.9, top_p=0.95, max_tokens=10, logprobs=2)
    out = await engine.generate(PROMPT, params)
    alone = await asyncio.gather(*(engine.generate(PROMPT, _alone(params, i)) for i in range(4)))
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    for o, a in zip(out.outputs, alone):
        assert (o.token_ids, o.text, o.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert o.logprobs is not None and a.logprobs is not None and len(o.logprobs) == len(o.token_ids)
        for mine, theirs in zip(o.logprobs, a.logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "seeds s + i draw different samples"
    # The top-level fields are sample 0's; the metrics cover the request.
    assert (out.text, out.token_ids, out.finish_reason) == (alone[0].text, alone[0].token_ids, "length")
    assert out.metrics is not None and out.metrics.num_generated_tokens == 40
    assert out.metrics.num_prompt_tokens == len(PROMPT)
    unseeded = await engine.generate(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=8))
    assert len({tuple(o.token_ids) for o in unseeded.outputs}) == 3


async def test_samples_share_the_prompts_blocks_while_they_run(engine: AsyncLLMEngine) -> None:
    """4 samples of 21 prompt tokens in blocks of 4: 5 shared blocks and one or two of its own each (9 to
    13 blocks in use), where 4 requests hold 6 blocks each as soon as their prompts are in (24 or more)."""
    total = engine.stats()["num_total_blocks"]

    async def peak_in_use(stream: Any) -> int:
        peak = 0
        async for chunk in stream:
            if not chunk.finished:
                peak = max(peak, total - engine.stats()["num_free_blocks"])
            await asyncio.sleep(0)
        return peak

    long = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    shared = await peak_in_use(engine.stream(PROMPT, SamplingParams(n=4, **long)))
    assert 9 <= shared <= 13
    alone = await asyncio.gather(*(peak_in_use(engine.stream(PROMPT, SamplingParams(**long))) for _ in range(4)))
    assert max(alone) >= 24
    assert (await wait_drained(engine))["num_free_blocks"] == total


async def test_stream_labels_chunks_and_ends_after_the_last_sample(engine: AsyncLLMEngine) -> None:
    """Each sample stops on its own: a stop string taken from sample 0's text stops it early while the
    others run on (or stop where they meet it); each equals its independent request, text included."""
    plain = SamplingParams(n=4, seed=21, temperature=1.0, max_tokens=16, ignore_eos=True)
    first = (await engine.generate("Hello", plain)).outputs[0].text
    stop = first[4:6] if len(first) > 6 else first[-2:]
    params = dataclasses.replace(plain, stop=[stop])
    by, chunks = await _by_sample(engine.stream("Hello", params))
    assert sorted(by) == [0, 1, 2, 3]
    assert chunks[-1].finish_reason is not None
    for i, mine in by.items():
        assert [c.finish_reason for c in mine[:-1]] == [None] * (len(mine) - 1) and mine[-1].finished
        alone = await engine.generate("Hello", _alone(params, i))
        assert "".join(c.text for c in mine) == alone.text
        assert [t for c in mine for t in c.token_ids] == alone.token_ids
        assert mine[-1].finish_reason == alone.finish_reason
    assert by[0][-1].finish_reason == "stop"


async def test_a_lagging_reader_gets_merged_chunks_one_sample_each(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(n=3, seed=2, temperature=1.0, max_tokens=12, ignore_eos=True)
    stream = engine.stream(PROMPT, params)
    while engine.num_live_requests:  # every token is in before the first read
        await asyncio.sleep(0.01)
    by, chunks = await _by_sample(stream)
    whole = await engine.generate(PROMPT, params)
    assert len(chunks) == 3  # one merged chunk per sample
    for i, mine in by.items():
        assert [t for c in mine for t in c.token_ids] == whole.outputs[i].token_ids


async def test_leaving_the_stream_cancels_every_sample(engine: AsyncLLMEngine) -> None:
    endless = SamplingParams(n=4, temperature=1.0, max_tokens=200, ignore_eos=True)
    stream = engine.stream(PROMPT, endless)
    async for _ in stream:
        break
    await stream.aclose()
    await wait_drained(engine)

    async def read_until_cancelled() -> None:
        async for _ in engine.stream(PROMPT, endless):
            pass

    task = asyncio.create_task(read_until_cancelled())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_drained(engine)


@pytest.mark.parametrize("prompt", [PROMPT, "Hello there"])  # text: the abort may find it still tokenizing
async def test_abort_ends_every_sample_with_abort(engine: AsyncLLMEngine, prompt: Any) -> None:
    stream = engine.add_request(prompt, SamplingParams(n=3, max_tokens=200, ignore_eos=True))
    await engine.abort(stream.request_id)
    by, chunks = await _by_sample(stream)
    assert sorted(by) == [0, 1, 2] and all(mine[-1].finish_reason == "abort" for mine in by.values())
    assert sum(c.finished for c in chunks) == 3
    await wait_drained(engine)


def test_preempted_samples_resume_and_equal_their_independent_requests(tiny_model: Path) -> None:
    """12 blocks for 4 samples that need 14 (9 prompt tokens, 12 generated: 2 shared blocks + 4 x 3 of their
    own): samples are preempted and recomputed; the blocks their siblings read are never freed under them."""
    params = SamplingParams(n=4, seed=8, temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = PROMPT[:9]
    tight = LLM(str(tiny_model), **{**ENGINE_ARGS, "num_kv_blocks": 12})
    try:
        out = tight.generate([prompt], params, use_tqdm=False)[0]
        assert tight.stats()["num_preemptions"] > 0
        assert tight.stats()["num_free_blocks"] == 12
    finally:
        tight.shutdown()
    roomy = LLM(str(tiny_model), **ENGINE_ARGS)
    try:
        alone = roomy.generate([prompt] * 4, [_alone(params, i) for i in range(4)], use_tqdm=False)
        both = roomy.generate([prompt, PROMPT], [params, dataclasses.replace(params, n=2)], use_tqdm=False)
    finally:
        roomy.shutdown()
    assert [o.token_ids for o in out.outputs] == [a.token_ids for a in alone]
    assert len(both) == 2 and [len(b.outputs) for b in both] == [4, 2]  # one RequestOutput per prompt
    assert [o.token_ids for o in both[0].outputs] == [a.token_ids for a in alone]


@pytest.mark.needs_structured_output
def test_every_sample_satisfies_the_constraint(tiny_model: Path) -> None:
    from tests.structured.conftest import MAX_TOKENS, PERSON, check

    params = SamplingParams(n=4, json_schema=PERSON, temperature=1.0, seed=3, max_tokens=MAX_TOKENS)
    llm = LLM(str(tiny_model), **ENGINE_ARGS)
    try:
        out = llm.generate(["Hello"], params, use_tqdm=False)[0]
        alone = llm.generate(["Hello"] * 4, [_alone(params, i) for i in range(4)], use_tqdm=False)
    finally:
        llm.shutdown()
    for o, a in zip(out.outputs, alone):
        assert o.finish_reason == "stop" and o.token_ids == a.token_ids
        check("person", o.text)
    assert len({o.text for o in out.outputs}) > 1


def test_samples_from_trio(engine: AsyncLLMEngine) -> None:
    async def scenario() -> list[list[int]]:
        out = await engine.generate(PROMPT, SamplingParams(n=3, seed=4, temperature=1.0, max_tokens=5))
        stream = engine.stream(PROMPT, SamplingParams(n=3, max_tokens=300, ignore_eos=True))
        with anyio.move_on_after(0.2):
            async for _ in stream:
                pass
        await stream.aclose()
        return [o.token_ids for o in out.outputs]

    samples = anyio.run(scenario, backend="trio")
    assert len(samples) == 3 and all(len(s) == 5 for s in samples)


@pytest.mark.parametrize(
    "n, match",
    [(0, "n=0"), (-2, "n=-2"), (129, "n=129"), ("2", "n='2'"), (2.0, "n=2.0"), (True, "n=True"), (None, "n=None")],
)
def test_bad_n_is_refused_naming_n(n: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{match} is invalid: an integer in \[1, 128\]"):
        SamplingParams(n=n)  # type: ignore[arg-type]


def test_best_of_is_not_offered() -> None:
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(best_of=2)  # type: ignore[call-arg]


async def test_branching_mid_generation_reuses_the_parents_blocks(tiny_model: Path, engine: AsyncLLMEngine) -> None:
    """The documented way to fork a running stream: a request for its prompt plus the tokens read so far.
    With the prefix cache (the default) the parent's full blocks, registered as they fill, serve every full
    block of the fork's prompt while the parent runs: the fork computes only its last partial block."""
    cached = AsyncLLMEngine(str(tiny_model), **{**ENGINE_ARGS, "enable_prefix_caching": True})
    try:
        parent = cached.stream(PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=200, ignore_eos=True))
        read: list[int] = []
        async for chunk in parent:
            read += chunk.token_ids
            if len(read) >= 10:
                break
        branch = [*PROMPT, *read]
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        fork = await cached.generate(branch, greedy)
        await parent.aclose()
        assert fork.metrics is not None and fork.metrics.num_cached_tokens == (len(branch) - 1) // 4 * 4
        assert fork.token_ids == (await engine.generate(branch, greedy)).token_ids  # the same as computed afresh
        await wait_drained(cached)
    finally:
        cached.shutdown()


async def test_a_prompt_too_long_once_tokenized_fails_every_sample(engine: AsyncLLMEngine) -> None:
    stream = engine.stream("word " * 600, SamplingParams(n=3))  # too long: known once tokenized
    with pytest.raises(InvalidRequestError, match="prompt has 1800 tokens"):
        async for _ in stream:
            pass
    await wait_drained(engine)


async def test_engine_death_reaches_a_stream_of_samples(make_engine: Any) -> None:
    """Over the fake core (serial and overlapped): samples that ended keep their chunks, then the stream
    raises EngineDeadError."""
    from asyncllm import EngineDeadError

    fake, built = make_engine(step_delay=0.002, max_model_len=4096)
    stream = fake.stream([1, 5, 9], SamplingParams(n=3, max_tokens=4000, ignore_eos=True))
    chunks = []
    with pytest.raises(EngineDeadError):
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 6:
                built.executor.fail_after_steps = built.executor.num_steps  # the next forward pass raises
    assert {c.index for c in chunks} == {0, 1, 2} and not any(c.finished for c in chunks)
