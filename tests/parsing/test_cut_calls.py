"""A call the token limit cut off (finish reason "length"), in every format: given out as a call with its name
and its arguments as far as they got, never as `<tool_call>` markup in the content; left out when the cut
came before its name was whole. Regression: a forced call cut off by max_tokens came back as raw markup in
`content` with no tool calls, over HTTP and through `engine.chat`."""

from __future__ import annotations

import pytest

from asyncllm.parsing import ChatStreamParser, ToolParser
from asyncllm.parsing.hermes import HermesToolParser
from asyncllm.parsing.llama3_json import Llama3JsonToolParser
from asyncllm.parsing.mistral import MistralToolParser
from asyncllm.parsing.tool_parser import cut_call
from tests.parsing.streams import splits

CASES = [  # (parser, reply cut short, content, [(name, arguments so far)])
    (
        HermesToolParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "",
        [("get_weather", '{"city": "Par')],
    ),
    (HermesToolParser, 'Sure. <tool_call>{"name": "f"', "Sure.", [("f", "")]),
    (HermesToolParser, '<tool_call>{"name": "get_wea', "", []),  # the name was not whole
    (
        HermesToolParser,
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1',
        "",
        [("a", "{}"), ("b", '{"x": 1')],
    ),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"q": "ab', "", [("f", '{"q": "ab')]),
    (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "f", "parameters": {"q": 1}}; {"name": "g", "para',
        "",
        [("f", '{"q": 1}'), ("g", "")],
    ),
    (
        MistralToolParser,
        '[TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": {"n',
        "",
        [("f", '{"q": "x"}'), ("g", '{"n')],
    ),
    (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"q": "ab', "", [("f", '{"q": "ab')]),
]


def _run(make: type[ToolParser], pieces: list[str], cut: bool) -> tuple[str, list[tuple[str, str]]]:
    parser = make()
    out = [parser.feed(p) for p in pieces] + [parser.finish(cut)]
    return "".join(o.content for o in out), [(c.name, c.arguments) for c in parser.calls]


@pytest.mark.parametrize(("make", "reply", "content", "calls"), CASES)
def test_a_cut_call_is_a_call_as_far_as_it_got(
    make: type[ToolParser], reply: str, content: str, calls: list[tuple[str, str]]
) -> None:
    for pieces in splits(reply, max_cuts=1):
        assert _run(make, pieces, cut=True) == (content, calls), pieces


@pytest.mark.parametrize(("make", "reply"), [(make, reply) for make, reply, _, _ in CASES])
def test_an_unclosed_call_not_cut_by_the_limit_stays_content(make: type[ToolParser], reply: str) -> None:
    """Ended by a stop string or EOS inside an unfinished call: a malformed call, kept as text (unchanged)."""
    content, calls = _run(make, [reply], cut=False)
    assert content.endswith(reply[-3:]) and len(calls) <= 1  # a whole call before it stays a call


def test_the_chat_parser_cuts_only_on_length() -> None:
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    cut = ChatStreamParser(None, HermesToolParser()).read(reply, "length")
    assert cut.text == "" and cut.finish_reason == "length"
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("get_weather", '{"city": "Par')]
    stopped = ChatStreamParser(None, HermesToolParser()).read(reply, "stop")
    assert stopped.text == reply and not stopped.tool_calls


def test_cut_call_reads_escaped_names() -> None:
    assert cut_call('{"name": "a\\"b", "arguments": {') == ('a"b', "{")
    assert cut_call('{"nam') is None and cut_call('{"name": ""}') is None
