"""The grammar backend's own pieces: choices survive any characters, bounded strings become the equivalent
pattern (xgrammar#800), and the UTF-8 table admits exactly the valid encodings, ending only between
characters."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from asyncllm import InvalidRequestError
from asyncllm.structured import StructuredKind, StructuredOutput
from asyncllm.structured_output.backend import GrammarBackend, bounded_strings_as_patterns
from asyncllm.structured_output.utf8 import BOUNDARY, Utf8Table


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> GrammarBackend:
    return GrammarBackend(AutoTokenizer.from_pretrained(tiny_model), 384, [0])


def test_choices_match_exactly_whatever_their_characters(backend: GrammarBackend) -> None:
    choices = ['say "hi"\n', "back\\slash", "日本語 😀", "", "\x01"]
    compiled = backend.compile(StructuredOutput(StructuredKind.CHOICE, json.dumps(choices)))
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    matcher = xgr.GrammarMatcher(compiled)  # a prefix is not complete
    matcher.accept_string("say")
    assert not matcher.is_completed()


def test_errors_name_the_field_without_xgrammars_log_prefix(backend: GrammarBackend) -> None:
    with pytest.raises(InvalidRequestError) as info:
        backend.check(StructuredOutput(StructuredKind.REGEX, "a(b"))
    assert str(info.value).startswith("SamplingParams.regex is not a regular expression xgrammar supports: ")
    assert ".cc:" not in str(info.value)


def test_bounded_strings_become_the_equivalent_pattern() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 4},
            "b": {"type": "string", "minLength": 2},
            "c": {"type": "string", "maxLength": 3, "pattern": "^x+$"},  # has its own pattern: left alone
            "d": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 2}, "maxItems": 2},
            "e": {"type": ["null", "string"], "maxLength": 4},
        },
    }
    text = json.dumps(schema)
    out = json.loads(bounded_strings_as_patterns(text))
    props = out["properties"]
    assert props["c"] == schema["properties"]["c"] and props["d"]["maxItems"] == 2
    rng = random.Random(0)
    alphabet = ["a", "é", "日", '"', "\\", "\n", "\x1f", " "]
    for key, (low, high) in {"a": (0, 4), "b": (2, None), "d": (1, 2), "e": (0, 4)}.items():
        node = props[key]["items"] if key == "d" else props[key]
        assert "minLength" not in node and "maxLength" not in node
        for _ in range(300):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(7)))
            plain = not re.search(r'[\x00-\x1f"\\]', s)
            fits = low <= len(s) and (high is None or len(s) <= high)
            assert bool(re.fullmatch(node["pattern"][1:-1], s)) == (plain and fits), (key, s)  # ECMA anchors
    untouched = json.dumps({"type": "integer"})
    assert bounded_strings_as_patterns(untouched) is untouched


def _walk(table: Utf8Table, data: bytes) -> int:
    """Feed `data` one byte token at a time (token id = byte value): the end state, -1 when refused."""
    state = BOUNDARY
    for byte in data:
        if not (int(table.allowed[state][byte >> 5]) >> (byte & 31)) & 1:
            return -1
        state = table.advance(state, byte)
    return state


def test_utf8_table_admits_exactly_valid_utf8() -> None:
    stop = 256
    pieces = [bytes([b]) for b in range(256)] + [b"<eos>", b""]
    table = Utf8Table(pieces, [stop], words=-(-len(pieces) // 32))
    rng = random.Random(1)
    for _ in range(2000):
        text = "".join(
            chr(rng.choice([rng.randrange(0x80), rng.randrange(0x80, 0xD800), rng.randrange(0xE000, 0x110000)]))
            for _ in range(5)
        )
        assert _walk(table, text.encode()) == BOUNDARY
    invalid = [
        b"\x80",
        b"\xc0\x80",
        b"\xc1\xbf",
        b"\xe0\x80\x80",
        b"\xed\xa0\x80",
        b"\xf0\x80\x80\x80",
        b"\xf4\x90\x80\x80",
        b"\xf5",
        b"\xff",
        b"a\xc3a",
    ]
    for data in invalid:
        assert _walk(table, data) == -1, data
    for partial in [b"\xc3", b"\xe6\x97", b"\xf0\x9f\x98"]:
        state = _walk(table, partial)
        assert state not in (-1, BOUNDARY)
        assert not (int(table.allowed[state][stop >> 5]) >> (stop & 31)) & 1, "no stop within a character"
        assert (int(table.allowed[state][257 >> 5]) >> (257 & 31)) & 1, "a token of no bytes changes nothing"
    assert (int(table.allowed[BOUNDARY][stop >> 5]) >> (stop & 31)) & 1
