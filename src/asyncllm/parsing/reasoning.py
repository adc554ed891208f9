"""Splits a thinking model's streamed output into reasoning and answer (Qwen3 / DeepSeek-R1 `<think>` blocks).

Owns the rule for where reasoning starts and ends in text that arrives in arbitrary pieces; knows nothing of
tool calls or tokens. Nothing that might still become a tag reaches either stream until the next piece
decides it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from asyncllm.parsing.scan import held_prefix_len


@dataclass(frozen=True, slots=True)
class ReasoningTags:
    """The markers around a reasoning block."""

    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError(f"reasoning tags must be non-empty, got start={self.start!r} end={self.end!r}")


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


class _State(enum.Enum):
    OPENING = enum.auto()  # nothing decided yet: a start tag may still come
    REASONING = enum.auto()
    CLOSING = enum.auto()  # just past the end tag: newlines before the answer are dropped
    CONTENT = enum.auto()


def prompt_opens_reasoning(prompt: str, tags: ReasoningTags = ReasoningTags()) -> bool:
    """Whether the prompt leaves a reasoning block open, so the output starts inside it.

    DeepSeek-R1's and Qwen3-Thinking's templates end the prompt with `<think>\\n`; Qwen3 with thinking off
    ends it with an empty, closed block, after which the output is all answer.
    """
    return prompt.rfind(tags.start) > prompt.rfind(tags.end)


class ReasoningParser:
    """Feed output text in pieces, get (reasoning, content) deltas; `finish` flushes what was held.

    The rule: a reasoning block is the text between a start tag that opens the output (whitespace before it
    is dropped; with `start_in_reasoning` the prompt opened it, and a repeated start tag is swallowed) and
    the first end tag. Everything after it is content, tags included; output that does not open with a
    block is all content. A block that never closes is all reasoning. With `trim_newlines` (Qwen3's
    template does the same when it writes a past turn back) newlines just inside the block and just after
    it are dropped, so `<think>\\nR\\n</think>\\n\\nA` gives reasoning "R" and content "A".
    """

    def __init__(
        self, tags: ReasoningTags = ReasoningTags(), *, start_in_reasoning: bool = False, trim_newlines: bool = True
    ) -> None:
        self._tags = tags
        self._start_in_reasoning = start_in_reasoning
        self._trim = trim_newlines
        self._state = _State.OPENING
        self._buf = ""  # text not yet given out
        self._reasoning_started = False  # some non-newline reasoning was given out
        self._held_newlines = ""  # trailing reasoning newlines: dropped if the block ends right after them

    @property
    def in_reasoning(self) -> bool:
        """Whether the text decided so far leaves the output inside the reasoning block."""
        return self._state is _State.REASONING or (self._state is _State.OPENING and self._start_in_reasoning)

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        """Flush at the end of the output: a held partial tag is plain text of the stream it sits in."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state is _State.OPENING:
                rest = self._buf.lstrip()
                if rest.startswith(self._tags.start):
                    self._buf = rest[len(self._tags.start) :]
                    self._state = _State.REASONING
                elif self._tags.start.startswith(rest) and not final:
                    return ReasoningDelta("", "")  # all whitespace, or a possible start tag: wait
                else:
                    self._state = _State.REASONING if self._start_in_reasoning else _State.CONTENT
            elif self._state is _State.REASONING:
                end = self._buf.find(self._tags.end)
                if end >= 0:
                    reasoning.append(self._reasoning_piece(self._buf[:end], last=True))
                    self._buf = self._buf[end + len(self._tags.end) :]
                    self._state = _State.CLOSING
                    continue
                keep = 0 if final else held_prefix_len(self._buf, self._tags.end)
                reasoning.append(self._reasoning_piece(self._buf[: len(self._buf) - keep], last=final))
                self._buf = self._buf[len(self._buf) - keep :]
                break
            elif self._state is _State.CLOSING:
                if self._trim:
                    self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._state = _State.CONTENT
            else:
                content.append(self._buf)
                self._buf = ""
                break
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _reasoning_piece(self, piece: str, last: bool) -> str:
        """`piece` of reasoning, less the newlines `trim_newlines` drops at the block's two ends."""
        if not self._trim:
            return piece
        if not self._reasoning_started:
            piece = piece.lstrip("\n")
            self._reasoning_started = bool(piece)
        piece = self._held_newlines + piece
        if last:
            self._held_newlines = ""
            return piece.rstrip("\n")
        body = piece.rstrip("\n")
        self._held_newlines = piece[len(body) :]
        return body
