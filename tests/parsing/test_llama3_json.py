"""Llama 3.x JSON tool calls: the reply is one or several `;`-joined call objects, optionally after
`<|python_tag|>`; a reply that is not one is content, verbatim, whatever the split of the stream."""

from __future__ import annotations

import random

import pytest

from asyncllm.parsing.llama3_json import Llama3JsonToolParser
from tests.parsing.streams import run_tools, splits

WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
TIME = '{"name":"now","parameters":{"tz":"Asia/Tokyo"}}'
CALL_W = ("get_weather", '{"city": "Paris"}')
CALL_T = ("now", '{"tz": "Asia/Tokyo"}')

CASES = [  # (reply, content, [(name, arguments)])
    (WEATHER, "", [CALL_W]),
    ("\n  " + WEATHER + "\n", "", [CALL_W]),
    ("<|python_tag|>" + WEATHER, "", [CALL_W]),
    (WEATHER + "; " + TIME, "", [CALL_W, CALL_T]),
    (WEATHER + ";" + TIME + ";", "", [CALL_W, CALL_T]),
    (WEATHER + "\n" + TIME, "", [CALL_W, CALL_T]),
    (WEATHER + " I called it.", "I called it.", [CALL_W]),
    ('{"name": "f", "arguments": {"q": "東京 \\ud83c\\udf27"}}', "", [("f", '{"q": "東京 🌧"}')]),
    ('{"type": "function", "name": "f", "parameters": {}}', "", [("f", "{}")]),
    ("The weather is fine.", "The weather is fine.", []),
    ("  Hello {there}", "  Hello {there}", []),
    ('{"answer": 42} is JSON', '{"answer": 42} is JSON', []),  # an object that is not a call
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),  # cut off
    ("<|python_tag|>brave_search.call(query='x')", "<|python_tag|>brave_search.call(query='x')", []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ("<|python", "<|python", []),
    ("", "", []),
]


@pytest.mark.parametrize(("reply", "content", "calls"), CASES)
def test_every_split_gives_the_same_content_and_calls(reply: str, content: str, calls: list[tuple[str, str]]) -> None:
    for pieces in splits(reply, max_cuts=2 if len(reply) < 70 else 1):
        got_content, got_calls, called = run_tools(Llama3JsonToolParser, pieces)
        assert got_content == content, pieces
        assert [(c.name, c.arguments) for c in got_calls] == calls, pieces
        assert called is bool(calls)


def test_a_bad_object_after_a_call_keeps_the_call_and_is_content() -> None:
    content, calls, called = run_tools(Llama3JsonToolParser, [WEATHER + '; {"nope": 1}'])
    assert [(c.name, c.arguments) for c in calls] == [CALL_W] and called
    assert content == '; {"nope": 1}'


def test_each_call_is_given_out_when_its_braces_close() -> None:
    parser = Llama3JsonToolParser(random.Random(0))
    assert parser.feed('{"name": "get_weather", ') == ("", ())
    _, (first,) = parser.feed('"parameters": {"city": "Paris"}}; {"name"')
    assert (first.index, first.name, first.arguments) == (0, *CALL_W)
    _, (second,) = parser.feed(':"now","parameters":{"tz":"Asia/Tokyo"}}')
    assert (second.index, second.name, second.arguments) == (1, *CALL_T)
    assert parser.finish() == ("", ())
