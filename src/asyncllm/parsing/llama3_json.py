"""Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several joined by `;`. A reply that does not open with one is all content."""

from __future__ import annotations

import enum
import random

from asyncllm.parsing.scan import JsonSpan
from asyncllm.parsing.tool_parser import ToolParser, load_json

TAG = "<|python_tag|>"


class _State(enum.Enum):
    START = enum.auto()  # before the reply's first non-whitespace text
    EXPECT_OBJECT = enum.auto()  # a call object must come next
    OBJECT = enum.auto()  # inside a call object, until its braces close
    AFTER_CALL = enum.auto()  # `;` or `{` continues the calls; anything else is content
    CONTENT = enum.auto()  # no more calls: everything is content


class Llama3JsonToolParser(ToolParser):
    """Calls are recognised only where the reply opens and right after a call; each object is given out as
    soon as its braces close. The first object that is not a call turns the rest of the reply, and the text
    held for it, into content."""

    name = "llama3_json"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._state = _State.START
        self._buf = ""  # undecided text after `_object`
        self._raw = ""  # text since the last call that is not in `_buf` or `_object` (content if no call comes)
        self._object = ""  # the call object read so far
        self._span = JsonSpan()

    def _consume(self, text: str) -> None:
        self._buf += text
        while self._buf:
            rest = self._buf.lstrip()
            space = self._buf[: len(self._buf) - len(rest)]
            if self._state is _State.START:
                if rest.startswith(TAG):
                    self._raw, self._buf = space + TAG, rest[len(TAG) :]
                    self._state = _State.EXPECT_OBJECT
                elif rest.startswith("{"):
                    self._raw, self._buf = space, rest
                    self._state = _State.EXPECT_OBJECT
                elif TAG.startswith(rest):
                    return  # whitespace, or what may be the tag: wait
                else:
                    self._state = _State.CONTENT
            elif self._state is _State.EXPECT_OBJECT:
                if not rest:
                    return
                if not rest.startswith("{"):
                    self._to_content()
                    continue
                self._raw += space
                self._buf, self._object, self._span = rest, "", JsonSpan()
                self._state = _State.OBJECT
            elif self._state is _State.OBJECT:
                end = self._span.feed(self._buf)
                if end is None:
                    self._object, self._buf = self._object + self._buf, ""
                    return
                self._object, self._buf = self._object + self._buf[:end], self._buf[end:]
                if self._call_or_text(load_json(self._object), self._raw + self._object):
                    self._raw, self._object = "", ""
                    self._state = _State.AFTER_CALL
                else:
                    self._raw, self._object = "", ""
                    self._state = _State.CONTENT
            elif self._state is _State.AFTER_CALL:
                if not rest:
                    return
                if rest.startswith(";"):
                    self._raw, self._buf = space + ";", rest[1:]
                    self._state = _State.EXPECT_OBJECT
                elif rest.startswith("{"):
                    self._raw, self._buf = space, rest
                    self._state = _State.EXPECT_OBJECT
                else:
                    self._state = _State.CONTENT
            else:
                self._text(self._buf)
                self._buf = ""

    def _to_content(self) -> None:
        """No call after all: what was held becomes content, and so does the rest of the reply."""
        self._buf = self._raw + self._object + self._buf
        self._raw, self._object = "", ""
        self._state = _State.CONTENT

    def _consume_end(self) -> None:
        if self._state is _State.EXPECT_OBJECT and self.called and not self._buf.strip():
            self._raw = ""  # a `;` after the last call separates nothing
        if self._state is _State.OBJECT and self._cut:  # a call the token limit cut off
            self._open_call(self._object + self._buf, "")
            self._raw, self._object, self._buf = "", "", ""
        if self._state in (_State.EXPECT_OBJECT, _State.OBJECT):
            self._to_content()
        self._text(self._raw + self._buf)
        self._raw, self._buf = "", ""
