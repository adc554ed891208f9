"""Mistral tool calls, both shapes its tokenizers use: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
(an `"id"` in an object is ignored: ids are ours; a lone object without the array is read too) and the
newer `[TOOL_CALLS]name[ARGS]{...}` (optionally `name[CALL_ID]id[ARGS]{...}`; `name{...}` where the
decoder dropped `[ARGS]`), repeated. Text outside the calls stays content. `[TOOL_CALLS]` is a special
token: the text fed here must be decoded with special tokens kept."""

from __future__ import annotations

import enum
import random
from typing import Any

from asyncllm.parsing.scan import JsonSpan, held_prefix_len
from asyncllm.parsing.tool_parser import ToolParser, call_fields, load_json

TAG = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class _State(enum.Enum):
    TEXT = enum.auto()  # content, watching for `TAG`
    AFTER_TAG = enum.auto()  # `[` opens an array of calls, `{` one call; anything else starts a name
    CALLS = enum.auto()  # inside the array (or the one call object), until it closes
    NAME = enum.auto()  # `name[ARGS]`, `name[CALL_ID]id[ARGS]`, or `name` right before its `{`
    EXPECT_ARGS = enum.auto()  # the arguments object must come next
    ARGS = enum.auto()  # inside the arguments object, until its braces close


class MistralToolParser(ToolParser):
    """Calls are held until their JSON closes; an array is given out only when every object in it is a
    call, else it is content, tag and all."""

    name = "mistral"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._state = _State.TEXT
        self._buf = ""  # undecided text after `_json`
        self._raw = ""  # the current call's text before `_json` (content if it proves malformed)
        self._json = ""  # the array or arguments object read so far
        self._span = JsonSpan()
        self._name = ""

    def _consume(self, text: str) -> None:
        self._buf += text
        while self._buf:
            rest = self._buf.lstrip()
            if self._state is _State.TEXT:
                start = self._buf.find(TAG)
                if start < 0:
                    keep = held_prefix_len(self._buf, TAG)
                    self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._text(self._buf[:start])
                self._raw, self._buf = TAG, self._buf[start + len(TAG) :]
                self._state = _State.AFTER_TAG
            elif self._state is _State.AFTER_TAG:
                if not rest:
                    return
                self._raw += self._buf[: len(self._buf) - len(rest)]
                self._buf = rest
                self._state = _State.NAME
                if rest.startswith(("[", "{")):
                    self._start_json(_State.CALLS)
            elif self._state is _State.NAME:
                ends = [i for i in (self._buf.find(ARGS), self._buf.find("{")) if i >= 0]
                if not ends:
                    return  # names are short: holding them whole costs nothing
                name_end = min(ends)
                after = name_end + (len(ARGS) if self._buf.startswith(ARGS, name_end) else 0)
                self._name = self._buf[:name_end].partition(CALL_ID)[0].strip()
                self._raw += self._buf[:after]
                self._buf = self._buf[after:]
                self._state = _State.EXPECT_ARGS
            elif self._state is _State.EXPECT_ARGS:
                if not rest:
                    return
                if not rest.startswith("{"):
                    self._text(self._raw)
                    self._raw, self._state = "", _State.TEXT
                    continue
                self._raw += self._buf[: len(self._buf) - len(rest)]
                self._buf = rest
                self._start_json(_State.ARGS)
            else:  # CALLS or ARGS
                end = self._span.feed(self._buf)
                if end is None:
                    self._json, self._buf = self._json + self._buf, ""
                    return
                self._json, self._buf = self._json + self._buf[:end], self._buf[end:]
                self._decide(load_json(self._json))
                self._raw, self._json, self._state = "", "", _State.TEXT

    def _start_json(self, state: _State) -> None:
        self._json, self._span, self._state = "", JsonSpan(), state

    def _decide(self, value: Any) -> None:
        """Calls from a closed array, call object or arguments object, or its text as content."""
        if self._state is _State.ARGS:
            name_ok = bool(self._name) and not any(c.isspace() for c in self._name)
            fields = [call_fields({"name": self._name, "arguments": value}) if name_ok else None]
        elif isinstance(value, list):
            fields = [call_fields(obj) for obj in value] if value else [None]
        else:
            fields = [call_fields(value)]
        if any(f is None for f in fields):
            self._text(self._raw + self._json)
            return
        for f in fields:
            assert f is not None
            self._call(*f)

    def _cut_calls(self, body: str) -> None:
        """The calls of an array (or lone object) the token limit cut off: each whole one, then the last."""
        rest = body.lstrip().removeprefix("[")
        while rest := rest.lstrip().removeprefix(",").lstrip():
            end = JsonSpan().feed(rest) if rest.startswith("{") else None
            if end is None:
                self._open_call(rest, "")
                return
            fields = call_fields(load_json(rest[:end]))
            if fields is not None:
                self._call(*fields)
            rest = rest[end:]

    def _consume_end(self) -> None:
        if self._cut and self._state is _State.ARGS:  # a call the token limit cut off, its name known
            self._open_call(self._json + self._buf, "", self._name)
            self._raw, self._json, self._buf = "", "", ""
        elif self._cut and self._state is _State.CALLS:  # inside the array: its whole objects, then the cut one
            self._cut_calls(self._json + self._buf)
            self._raw, self._json, self._buf = "", "", ""
        self._text(self._raw + self._json + self._buf)
        self._raw, self._json, self._buf, self._state = "", "", "", _State.TEXT
