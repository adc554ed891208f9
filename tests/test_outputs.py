"""`OutputAccumulator`, the one place a request's deltas add up (the stream's mailbox, `collect`, `LLM` and the
server all use it): chunks taken as they come and the whole result agree, whatever the lag."""

from __future__ import annotations

import random

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import CompletionOutput, OutputAccumulator, RequestMetrics, SamplesAccumulator

METRICS = RequestMetrics(0.1, 0.5, 3, 4, 0)


def _deltas(rng: random.Random) -> list[tuple[str, list[int], list[dict[int, float]]]]:
    return [
        (rng.choice(["", "a", "bc", "日本", "😀"]), [rng.randrange(100)], [{rng.randrange(100): -1.0}])
        for _ in range(rng.randrange(1, 12))
    ]


@pytest.mark.parametrize("seed", range(20))
def test_chunks_at_any_lag_join_to_the_whole_result(seed: int) -> None:
    rng = random.Random(seed)
    deltas = _deltas(rng)
    whole, lagging = OutputAccumulator(), OutputAccumulator()
    chunks = []
    for i, (text, ids, logprobs) in enumerate(deltas):
        final = i == len(deltas) - 1
        for acc in (whole, lagging):
            acc.add(text, ids, logprobs, "length" if final else None, METRICS if final else None)
        if rng.random() < 0.4 or final:  # the consumer reads now and then: several deltas merge into one chunk
            chunk = lagging.take_chunk("r")
            if chunk is not None:
                chunks.append(chunk)
    assert lagging.take_chunk("r") is not None  # the final chunk stays readable: the finish reason is kept
    out = whole.result("r", [1, 2])
    assert "".join(c.text for c in chunks) == out.text == "".join(t for t, _, _ in deltas)
    assert [t for c in chunks for t in c.token_ids] == out.token_ids == [t for _, ids, _ in deltas for t in ids]
    assert [lp for c in chunks for lp in c.logprobs or ()] == out.logprobs
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].metrics == out.metrics == METRICS and out.finish_reason == "length"


def test_nothing_new_is_no_chunk_and_logprobs_only_when_asked() -> None:
    acc = OutputAccumulator()
    assert acc.take_chunk("r") is None
    acc.add("", [5], None)
    chunk = acc.take_chunk("r")
    assert chunk is not None and chunk.token_ids == (5,) and chunk.logprobs is None and chunk.text == ""
    assert acc.take_chunk("r") is None


def test_the_first_final_output_wins() -> None:
    """An abort that raced a finish: what comes after the first final delta is ignored."""
    acc = OutputAccumulator()
    acc.add("a", [1], None, "stop", METRICS)
    acc.add("b", [2], None, "abort", None)
    assert acc.finished and acc.result("r", []).text == "a" and acc.finish_reason == "stop"


def test_a_request_failing_alone_keeps_its_output_then_raises() -> None:
    acc = OutputAccumulator()
    acc.add("ab", [1, 2], None)
    acc.add("c", [3], None, "abort", METRICS, error="bad sampling state")
    chunk = acc.take_chunk("r")
    assert chunk is not None and chunk.text == "abc" and chunk.finish_reason is None  # the error, not a finish
    assert acc.take_chunk("r") is None and acc.finished
    with pytest.raises(InvalidRequestError, match="bad sampling state"):
        acc.result("r", [])


@pytest.mark.parametrize("seed", range(10))
def test_samples_chunks_at_any_lag_keep_samples_apart_and_join_to_the_whole(seed: int) -> None:
    """n > 1: deltas of the samples interleave; every chunk is one sample's, and each sample's chunks join
    to its whole output; the stream's last chunk is the one after which nothing is left."""
    rng = random.Random(seed)
    n = rng.randrange(2, 5)
    per_sample = [_deltas(rng) for _ in range(n)]
    order = [i for i in range(n) for _ in per_sample[i]]
    rng.shuffle(order)
    whole, lagging = SamplesAccumulator(n), SamplesAccumulator(n)
    cursor = [0] * n
    chunks = []
    for i in order:
        text, ids, logprobs = per_sample[i][cursor[i]]
        cursor[i] += 1
        final = cursor[i] == len(per_sample[i])
        for acc in (whole, lagging):
            acc.add(text, ids, logprobs, "stop" if final else None, METRICS if final else None, None, i)
        while rng.random() < 0.5 and (chunk := lagging.take_chunk("r")) is not None:
            chunks.append(chunk)
    while (chunk := lagging.take_chunk("r")) is not None:
        chunks.append(chunk)
    assert lagging.complete and lagging.is_last(chunks[-1]) and chunks[-1].finished
    out = whole.result("r", [1])
    for i in range(n):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == out.outputs[i].text == "".join(t for t, _, _ in per_sample[i])
        assert [t for c in mine for t in c.token_ids] == out.outputs[i].token_ids
        assert [c.finish_reason for c in mine].count("stop") == 1 and mine[-1].finish_reason == "stop"
    assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
    assert out.metrics is not None and out.metrics.num_generated_tokens == n * METRICS.num_generated_tokens


def test_samples_finish_when_the_last_sample_does_or_at_once_on_error() -> None:
    acc = SamplesAccumulator(2)
    acc.add("a", [1], None, "stop", METRICS, None, 0)
    assert not acc.finished
    acc.add("b", [2], None, "length", METRICS, None, 1)
    assert acc.finished
    failed = SamplesAccumulator(3)
    failed.add("x", [1], None, "abort", METRICS, None, 1)
    failed.add("y", [2], None, "abort", METRICS, "no token is allowed here", 0)
    assert failed.finished
    chunks = [failed.take_chunk("r"), failed.take_chunk("r")]
    assert [(c.index, c.finish_reason) for c in chunks if c] == [(1, "abort"), (0, None)]
    assert not failed.complete  # the error, not an end: the reader raises it next
    with pytest.raises(InvalidRequestError, match="no token"):
        failed.result("r", [])


def test_one_sample_result_lists_itself_in_outputs() -> None:
    acc = OutputAccumulator()
    acc.add("hi", [1, 2], None, "stop", METRICS)
    out = acc.result("r", [9])
    assert out.outputs == [CompletionOutput(0, "hi", [1, 2], "stop", None, METRICS)]


def test_prompt_logprobs_go_out_once_on_the_first_chunk() -> None:
    prompt = [None, {5: -1.0, 6: -0.5}]
    acc, whole = OutputAccumulator(), OutputAccumulator()
    for a in (acc, whole):
        a.add("a", [1], None, None, None, None, 0, prompt)
    first = acc.take_chunk("r")
    assert first is not None and first.prompt_logprobs == tuple(prompt)
    for a in (acc, whole):
        a.add("b", [2], None, "length", METRICS)
    last = acc.take_chunk("r")
    assert last is not None and last.prompt_logprobs is None
    assert whole.result("r", [5, 6]).prompt_logprobs == prompt
    rejoined = OutputAccumulator()
    rejoined.add_chunk(first)
    rejoined.add_chunk(last)
    assert rejoined.result("r", [5, 6]).prompt_logprobs == prompt
    plain = OutputAccumulator()
    plain.add("a", [1], None, "length", METRICS)
    assert plain.result("r", [5]).prompt_logprobs is None


def test_samples_prompt_logprobs_are_the_requests() -> None:
    """With n > 1 they come with one sample's delta and go out on the next chunk taken, whichever sample's."""
    prompt = [None, {7: -2.0}]
    acc, whole = SamplesAccumulator(2), SamplesAccumulator(2)
    for a in (acc, whole):
        a.add("x", [1], None, None, None, None, 1)
        a.add("y", [2], None, "length", METRICS, None, 0, prompt)
        a.add("z", [3], None, "length", METRICS, None, 1)
    first, second = acc.take_chunk("r"), acc.take_chunk("r")
    assert first is not None and first.index == 1 and first.prompt_logprobs == tuple(prompt)
    assert second is not None and second.prompt_logprobs is None
    out = whole.result("r", [6, 7])
    assert out.prompt_logprobs == prompt and len(out.outputs) == 2
