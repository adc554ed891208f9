"""`OutputAccumulator`, the one place a request's deltas add up (the stream's mailbox, `collect`, `LLM` and the
server all use it): chunks taken as they come and the whole result agree, whatever the lag."""

from __future__ import annotations

import random

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import OutputAccumulator, RequestMetrics

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
