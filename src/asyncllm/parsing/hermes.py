"""Hermes-style tool calls, which Qwen2.5, Qwen3 and their templates use: each call is one JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` lines, several in a row.
Text outside the tags stays content."""

from __future__ import annotations

import random

from asyncllm.parsing.scan import held_prefix_len
from asyncllm.parsing.tool_parser import ToolParser, load_json

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    """Each `<tool_call>` block is held until `</tool_call>` closes it (or the output ends with its JSON
    complete); a block whose JSON is not a call is given back as content, tags and all."""

    name = "hermes"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._buf = ""
        self._in_call = False
        self._search_from = 0  # inside a call: where `END` may start, so a long call is not rescanned

    def _consume(self, text: str) -> None:
        self._buf += text
        while True:
            if not self._in_call:
                start = self._buf.find(START)
                if start < 0:
                    keep = held_prefix_len(self._buf, START)
                    self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._text(self._buf[:start])
                self._buf = self._buf[start + len(START) :]
                self._in_call, self._search_from = True, 0
            else:
                end = self._buf.find(END, self._search_from)
                if end < 0:
                    self._search_from = max(0, len(self._buf) - len(END) + 1)
                    return
                body = self._buf[:end]
                self._call_or_text(load_json(body), START + body + END)
                self._buf = self._buf[end + len(END) :]
                self._in_call = False

    def _consume_end(self) -> None:
        if self._in_call:  # never closed: a call if its JSON is whole, or if the token limit cut it
            call = load_json(self._buf)
            if call is not None:
                self._call_or_text(call, START + self._buf)
            else:
                self._open_call(self._buf, START + self._buf)
        else:
            self._text(self._buf)
        self._buf, self._in_call = "", False
