"""A parsed chat reply in OpenAI's shapes: the whole `message`, or the streamed `delta`s of one chunk.

Owns the field names and the order OpenAI (and vLLM, for `reasoning_content`) writes them in: reasoning
before content before tool calls; a call's first delta carries its index, id, type and name with empty
arguments, the following ones its index and a piece of its arguments. Knows nothing of how the reply was
parsed or of the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncllm.parsing import ChatChunk, ToolCall


def whole_message(text: str, reasoning: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The non-streamed `message`: `content` is None when the reply only called tools (whitespace around
    the calls is not an answer); `tool_calls` and `reasoning_content` appear when there are some."""
    content: str | None = None if calls and not text.strip() else text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return message


def chunk_deltas(chunk: ChatChunk) -> list[dict[str, Any]]:
    """The deltas one parsed chunk streams as, in order (none for a chunk that holds nothing)."""
    deltas: list[dict[str, Any]] = []
    if chunk.reasoning_text:
        deltas.append({"reasoning_content": chunk.reasoning_text})
    if chunk.text:
        deltas.append({"content": chunk.text})
    for call in chunk.tool_calls:
        if call.id is not None:  # a call's first delta
            function = {"name": call.name, "arguments": ""}
            deltas.append(
                {"tool_calls": [{"index": call.index, "id": call.id, "type": "function", "function": function}]}
            )
        if call.arguments:
            deltas.append({"tool_calls": [{"index": call.index, "function": {"arguments": call.arguments}}]})
    return deltas
