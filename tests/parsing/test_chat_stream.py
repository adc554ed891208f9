"""The combined parser: reasoning first, then tool calls in the answer, "stop" read as "tool_calls" when a
call was made; a Qwen3-style reply gives the same chunks' sums whatever the split, hypothesis included."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.errors import UnsupportedModelError
from asyncllm.outputs import FinishReason
from asyncllm.parsing import (
    ChatChunk,
    ChatStreamParser,
    ParserChoice,
    ReasoningParser,
    ReasoningTags,
    chat_stream_parser,
    choose_parsers,
)
from asyncllm.parsing.hermes import HermesToolParser
from tests.parsing.streams import cut, run_chat, splits

QWEN3 = ParserChoice("hermes", ReasoningTags())
REPLY = (
    "<think>\nThe user wants Paris weather; I call the tool.\n</think>\n\n"
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
EXPECTED = (
    "The user wants Paris weather; I call the tool.",
    "Checking.",
    [("get_weather", '{"city": "Paris", "unit": "°C"}'), ("now", "{}")],
    "tool_calls",
)


def _qwen3() -> ChatStreamParser:
    return chat_stream_parser(QWEN3, "<|im_start|>assistant\n", with_tools=True, rng=random.Random(0))


def _summary(got: tuple[str, str, list, str | None]) -> tuple[str, str, list[tuple[str, str]], str | None]:
    reasoning, text, calls, reason = got
    return reasoning, text, [(c.name, c.arguments) for c in calls], reason


def test_qwen3_reasoning_then_tool_calls_over_every_split() -> None:
    ids = None
    for pieces in splits(REPLY, max_cuts=1):
        got = run_chat(_qwen3, pieces)
        assert _summary(got) == EXPECTED, pieces
        ids = ids or [c.id for c in got[2]]
        assert [c.id for c in got[2]] == ids  # the same seed draws the same ids
    assert ids is not None and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids) and len(set(ids)) == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(REPLY)), max_size=40))
def test_qwen3_reply_over_random_splits(points: list[int]) -> None:
    assert _summary(run_chat(_qwen3, cut(REPLY, tuple(sorted(points))))) == EXPECTED


@pytest.mark.parametrize(
    ("reason", "called", "expected"),
    [("stop", True, "tool_calls"), ("length", True, "length"), ("abort", True, "abort"), ("stop", False, "stop")],
)
def test_finish_reason(reason: FinishReason, called: bool, expected: str) -> None:
    reply = REPLY if called else "<think>x</think>Just text."
    assert run_chat(_qwen3, [reply], reason)[3] == expected


def test_a_call_inside_the_reasoning_is_reasoning() -> None:
    reply = '<think><tool_call>{"name": "f"}</tool_call></think>Fine.'
    assert _summary(run_chat(_qwen3, [reply])) == ('<tool_call>{"name": "f"}</tool_call>', "Fine.", [], "stop")


def test_without_tools_the_answer_passes_through() -> None:
    make = lambda: chat_stream_parser(QWEN3, "", with_tools=False)  # noqa: E731
    reasoning, text, calls, reason = run_chat(make, list(REPLY))
    assert reasoning == EXPECTED[0] and calls == [] and reason == "stop"
    assert text == REPLY[REPLY.index("Checking") :]


def test_an_open_block_in_the_prompt_starts_the_reply_in_reasoning() -> None:
    make = lambda: chat_stream_parser(QWEN3, "<|im_start|>assistant\n<think>\n", with_tools=False)  # noqa: E731
    assert run_chat(make, ["plan\n</think>\n\n4"])[:2] == ("plan", "4")
    plain = lambda: ChatStreamParser()  # noqa: E731
    assert run_chat(plain, ["<think>a</think>b"])[:2] == ("", "<think>a</think>b")


def test_tools_for_a_model_without_a_known_format_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="hermes"):
        chat_stream_parser(choose_parsers("{{ messages }}"), "", with_tools=True)
    chat_stream_parser(choose_parsers("{{ messages }}"), "", with_tools=False)


def test_chunks_carry_only_what_is_new() -> None:
    parser = ChatStreamParser(ReasoningParser(), HermesToolParser(random.Random(0)))
    assert parser.feed("<think>a") == ChatChunk("", "a", ())
    assert parser.feed("</think>b <tool_").empty is False
    assert parser.feed("call>").empty
    last = parser.finish("stop")
    assert (last.text, last.finish_reason) == (" <tool_call>", "stop")  # the space was held with the tag
