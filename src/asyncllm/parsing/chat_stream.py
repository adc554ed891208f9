"""One reply's raw text pieces -> `ChatChunk`s: reasoning is split off first, then tool calls are parsed out
of the answer that is left, and the finish reason says "tool_calls" when a call was made. Owns only that
order and that mapping; the formats belong to the parsers it is given."""

from __future__ import annotations

import random

from asyncllm.errors import UnsupportedModelError
from asyncllm.outputs import FinishReason
from asyncllm.parsing.reasoning import ReasoningParser, prompt_opens_reasoning
from asyncllm.parsing.registry import TOOL_PARSERS, ParserChoice, make_tool_parser
from asyncllm.parsing.tool_parser import ToolParser
from asyncllm.parsing.types import ChatChunk, ChatFinishReason, ToolCall, ToolCallDelta


class ChatStreamParser:
    """Feed the reply's text as it is decoded; `finish` with the engine's finish reason gives the last chunk.

    Without a reasoning parser all text is answer; without a tool parser (the request offered no tools)
    the answer is passed through untouched. A tool call inside the reasoning is reasoning, not a call.
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls made so far, whole (what a non-streamed response lists)."""
        return list(self._tools.calls) if self._tools is not None else []

    def feed(self, text: str) -> ChatChunk:
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        answer, calls = self._answer(content, last=False)
        return ChatChunk(answer, reasoning, calls)

    def read(self, text: str, finish_reason: FinishReason | None = None) -> ChatChunk:
        """One engine output: its text fed, and with its finish reason the last chunk joined on."""
        chunk = self.feed(text)
        if finish_reason is None:
            return chunk
        last = self.finish(finish_reason)
        return ChatChunk(
            chunk.text + last.text,
            chunk.reasoning_text + last.reasoning_text,
            chunk.tool_calls + last.tool_calls,
            last.finish_reason,
        )

    def finish(self, finish_reason: FinishReason) -> ChatChunk:
        """The last chunk: what was held back, and "stop" read as "tool_calls" when the reply called tools."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        answer, calls = self._answer(content, last=True, cut=finish_reason == "length")
        called = self._tools is not None and self._tools.called
        reason: ChatFinishReason = "tool_calls" if finish_reason == "stop" and called else finish_reason
        return ChatChunk(answer, reasoning, calls, reason)

    def _answer(self, content: str, last: bool, cut: bool = False) -> tuple[str, tuple[ToolCallDelta, ...]]:
        if self._tools is None:
            return content, ()
        text, calls = self._tools.feed(content) if content else ("", ())
        if last:
            tail, more = self._tools.finish(cut)
            text, calls = text + tail, calls + more
        return text, calls


def chat_stream_parser(
    choice: ParserChoice, prompt: str, *, with_tools: bool, rng: random.Random | None = None
) -> ChatStreamParser:
    """The parser for one reply to `prompt` (the templated prompt text, which says whether the output
    starts inside an open reasoning block); tool calls are parsed only when the request offered tools and
    the model has a known format (else `UnsupportedModelError`)."""
    if with_tools and choice.tool_parser is None:
        raise UnsupportedModelError(
            "this model's chat template shows no tool-call format asyncllm can parse "
            f"(known: {', '.join(sorted(TOOL_PARSERS))}): call it without tools"
        )
    reasoning = None
    if choice.reasoning is not None:
        opened = prompt_opens_reasoning(prompt, choice.reasoning)
        reasoning = ReasoningParser(choice.reasoning, start_in_reasoning=opened)
    tools = make_tool_parser(choice.tool_parser, rng) if with_tools and choice.tool_parser is not None else None
    return ChatStreamParser(reasoning, tools)
