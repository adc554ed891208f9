"""Mistral tool calls: the `[TOOL_CALLS][...]` array and the newer `[TOOL_CALLS]name[ARGS]{...}` shape,
content around them, malformed calls kept as content, whatever the split of the stream."""

from __future__ import annotations

import pytest

from asyncllm.parsing.mistral import MistralToolParser
from tests.parsing.streams import run_tools, splits

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name":"now","arguments":{"tz":"Asia/Tokyo"},"id":"a1b2c3d4e"}'  # the model's id is not ours
CALL_W = ("get_weather", '{"city": "Paris"}')
CALL_T = ("now", '{"tz": "Asia/Tokyo"}')

CASES = [  # (reply, content, [(name, arguments)])
    ("[TOOL_CALLS][" + W + "]", "", [CALL_W]),
    ("[TOOL_CALLS] [" + W + ", " + T + "]", "", [CALL_W, CALL_T]),
    ("Let me look.[TOOL_CALLS][" + W + "]\n", "Let me look.", [CALL_W]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [CALL_W]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}[TOOL_CALLS]now[ARGS]{"tz":"Asia/Tokyo"}', "", [CALL_W, CALL_T]),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{"tz": "Asia/Tokyo"}', "", [CALL_W, CALL_T]),
    ('[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS] {"tz": "Asia/Tokyo"}', "", [CALL_T]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"q": "ü [x]"}}]', "", [("f", '{"q": "ü [x]"}')]),
    ("[TOOL_CALLS]" + W, "", [CALL_W]),  # a lone object, without the array
    ("Plain [text] with [brackets]", "Plain [text] with [brackets]", []),
    ("ends in [TOOL_CA", "ends in [TOOL_CA", []),
]

MALFORMED = [  # each stays content verbatim
    "[TOOL_CALLS][" + W + ", {}]",  # one object is not a call: the array is content
    "[TOOL_CALLS][]",
    '[TOOL_CALLS][{"name": "f", "arguments": 3}]',
    "[TOOL_CALLS][" + W,  # never closed
    '[TOOL_CALLS]{"nom": "f"}',
    '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}',  # a name with a space is no function name
    "[TOOL_CALLS]get_weather[ARGS]Paris",
    "[TOOL_CALLS]get_weather",
    "[TOOL_CALLS]",
]


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_every_split_gives_the_same_content_and_calls(reply: str, content: str, calls: list[tuple[str, str]]) -> None:
    for pieces in splits(reply, max_cuts=2 if len(reply) < 90 else 1):
        got_content, got_calls, called = run_tools(MistralToolParser, pieces)
        assert got_content == content, pieces
        assert [(c.name, c.arguments) for c in got_calls] == calls, pieces
        assert called is bool(calls)


@pytest.mark.parametrize("block", MALFORMED)
def test_a_malformed_call_is_plain_content_and_no_call(block: str) -> None:
    reply = "Before. " + block
    for pieces in splits(reply, max_cuts=1):
        assert run_tools(MistralToolParser, pieces) == (reply, [], False), pieces


def test_a_good_call_after_a_malformed_one_is_still_a_call() -> None:
    content, calls, _ = run_tools(MistralToolParser, [MALFORMED[0] + '[TOOL_CALLS]now[ARGS]{"tz": "Asia/Tokyo"}'])
    assert content == MALFORMED[0]
    assert [(c.name, c.arguments) for c in calls] == [CALL_T]
