"""Feeding a parser a text in every way it can arrive: the splits, and runners that gather what comes out."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator

from asyncllm.outputs import FinishReason
from asyncllm.parsing import ChatStreamParser, ReasoningParser, ToolCall, ToolParser, merge_tool_call_deltas


def cut(text: str, points: tuple[int, ...]) -> list[str]:
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def splits(text: str, max_cuts: int = 2) -> Iterator[list[str]]:
    """Whole, one character at a time, and cut at every choice of up to `max_cuts` points (empty pieces too)."""
    yield [text]
    yield list(text)
    for n in range(1, max_cuts + 1):
        for points in itertools.combinations_with_replacement(range(len(text) + 1), n):
            yield cut(text, points)


def run_reasoning(make: Callable[[], ReasoningParser], pieces: list[str]) -> tuple[str, str]:
    parser = make()
    out = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def run_tools(make: Callable[[random.Random], ToolParser], pieces: list[str]) -> tuple[str, list[ToolCall], bool]:
    """(content, calls merged from the deltas, whether `finish` said a tool was called); ids drawn from seed 0."""
    parser = make(random.Random(0))
    out = [parser.feed(p) for p in pieces] + [parser.finish()]
    calls = merge_tool_call_deltas(d for parse in out for d in parse.calls)
    assert calls == parser.calls, "the deltas add up to the calls the parser lists"
    return "".join(parse.content for parse in out), calls, parser.called


def run_chat(
    make: Callable[[], ChatStreamParser], pieces: list[str], finish_reason: FinishReason = "stop"
) -> tuple[str, str, list[ToolCall], str | None]:
    """(reasoning, answer text, calls, final finish reason)."""
    parser = make()
    chunks = [parser.feed(p) for p in pieces] + [parser.finish(finish_reason)]
    assert all(c.finish_reason is None for c in chunks[:-1])
    calls = merge_tool_call_deltas(d for c in chunks for d in c.tool_calls)
    assert calls == parser.tool_calls
    reasoning = "".join(c.reasoning_text for c in chunks)
    return reasoning, "".join(c.text for c in chunks), calls, chunks[-1].finish_reason
