"""Hermes / Qwen tool calls: one or several `<tool_call>` blocks, content around them, malformed blocks kept
as content, arguments re-encoded in the one documented form, whatever the split of the stream."""

from __future__ import annotations

import pytest

from asyncllm.parsing import ToolCall
from asyncllm.parsing.hermes import HermesToolParser
from tests.parsing.streams import run_tools, splits

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name":"now","arguments":{"tz":"Europe/Paris","fmt":"%H:%M"}}\n</tool_call>'

CASES = [  # (reply, content, [(name, arguments)])
    (WEATHER, "", [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n\n" + WEATHER, "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (
        WEATHER + "\n" + TIME + "\n",
        "",
        [("get_weather", '{"city": "Paris"}'), ("now", '{"tz": "Europe/Paris", "fmt": "%H:%M"}')],
    ),
    (WEATHER + "\nDone, I called it.", "Done, I called it.", [("get_weather", '{"city": "Paris"}')]),
    (
        "A " + WEATHER + " B " + TIME,
        "A B",
        [("get_weather", '{"city": "Paris"}'), ("now", '{"tz": "Europe/Paris", "fmt": "%H:%M"}')],
    ),
    ("Checking.\n\n" + WEATHER + "\n\nDone.", "Checking.\n\nDone.", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),  # no arguments
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2.5]}"}</tool_call>', "", [("f", '{"a": [1, 2.5]}')]),
    ('<tool_call>{"name": "f", "arguments": {"q": "caf\\u00e9 🌧"}}</tool_call>', "", [("f", '{"q": "café 🌧"}')]),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool"}}</tool_call>', "", [("f", '{"s": "</tool"}')]),
    ('<tool_call>\n{"name": "f", "arguments": {}}', "", [("f", "{}")]),  # the output ended before the close tag
    ("2 < 3 and <b>bold</b>, plain", "2 < 3 and <b>bold</b>, plain", []),
    ("  spaced  out  ", "  spaced  out  ", []),
    ("ends with <tool", "ends with <tool", []),
]

MALFORMED = [  # each stays content verbatim
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # missing brace
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "f", "arguments": {"a": ',  # cut off by max_tokens
    "<tool_call>",
]


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_every_split_gives_the_same_content_and_calls(reply: str, content: str, calls: list[tuple[str, str]]) -> None:
    for pieces in splits(reply, max_cuts=2 if len(reply) < 90 else 1):
        got_content, got_calls, called = run_tools(HermesToolParser, pieces)
        assert got_content == content, pieces
        assert [(c.name, c.arguments) for c in got_calls] == calls, pieces
        assert called is bool(calls)


@pytest.mark.parametrize("block", MALFORMED)
def test_a_malformed_call_is_plain_content_and_no_call(block: str) -> None:
    reply = "Before. " + block
    for pieces in splits(reply, max_cuts=1):
        assert run_tools(HermesToolParser, pieces) == (reply, [], False), pieces


def test_a_malformed_call_does_not_hide_a_good_one_after_it() -> None:
    reply = MALFORMED[0] + WEATHER
    content, calls, called = run_tools(HermesToolParser, [reply])
    assert content == MALFORMED[0]
    assert [c.name for c in calls] == ["get_weather"] and called


def test_a_call_is_one_delta_given_out_when_its_block_closes() -> None:
    import random

    parser = HermesToolParser(random.Random(0))
    assert parser.feed("Hi <tool_") == ("Hi", ())
    assert parser.feed('call>\n{"name": "get_weather", "arguments": {"city": ') == ("", ())
    content, (delta,) = parser.feed('"Paris"}}\n</tool_call>')
    assert content == "" and delta.index == 0 and delta.name == "get_weather"
    assert delta.id is not None and delta.arguments == '{"city": "Paris"}'
    assert parser.calls == [ToolCall(delta.id, "get_weather", '{"city": "Paris"}')]
    assert parser.finish() == ("", ())
