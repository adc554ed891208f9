"""The scanning helpers: `held_prefix_len` against its slow twin over every short text, and `JsonSpan`
finding where an object or array closes whatever the pieces, strings and escapes inside it."""

from __future__ import annotations

import itertools
import json

import pytest

from asyncllm.parsing.scan import JsonSpan, held_prefix_len
from tests.parsing.streams import splits


def held_prefix_len_ref(text: str, tag: str) -> int:
    """The specification: try every proper prefix of the tag, longest first."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@pytest.mark.parametrize("tag", ["<think>", "</tool_call>", "[TOOL_CALLS]", "aab", "aaa", "<|python_tag|>"])
def test_held_prefix_len_matches_its_reference(tag: str) -> None:
    alphabet = sorted(set(tag[:3] + "<x/"))
    for n in range(6):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert held_prefix_len(text, tag) == held_prefix_len_ref(text, tag), text
    for k in range(len(tag)):
        assert held_prefix_len("xx" + tag[:k], tag) == k


@pytest.mark.parametrize(
    "value",
    [
        {"a": "}", "b": ["]", {"c": '\\"}'}], "d": 'q"{'},
        [{"name": "f", "arguments": {}}, {"name": "g"}],
        {"emoji": "🌧", "nested": [[[]]], "empty": {}},
    ],
)
def test_json_span_finds_the_close_in_any_split(value: object) -> None:
    text = json.dumps(value, ensure_ascii=False)
    tail = " ; more [text]"
    for pieces in splits(text + tail, max_cuts=1):
        span, seen, end = JsonSpan(), 0, None
        for piece in pieces:
            if (at := span.feed(piece)) is not None:
                end = seen + at
                break
            seen += len(piece)
        assert end == len(text), pieces
