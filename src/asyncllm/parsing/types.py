"""What a chat stream gives back: chunks of answer text, reasoning text and tool-call deltas.

Plain data, shaped so the server can write OpenAI's streamed `delta` objects field for field. Owns the one
rule for a call's id (`call_` + 24 alphanumerics) and for its arguments text (`encode_arguments`).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

ChatFinishReason = Literal["stop", "length", "abort", "timeout", "tool_calls"]

_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 24  # OpenAI's ids read `call_` + 24 alphanumerics


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One piece of one tool call, as OpenAI streams it.

    `index` numbers the calls of one reply from 0; `id` and `name` are set only on a call's first delta;
    concatenating a call's `arguments` pieces gives the JSON text of its arguments object
    (`encode_arguments` of it).
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A finished tool call: `arguments` is the JSON text of its arguments object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatChunk:
    """What one step of a chat stream adds: answer text, reasoning text, tool-call deltas.

    Concatenating every chunk's `text` gives the answer, every chunk's `reasoning_text` the reasoning.
    `finish_reason` is None until the last chunk; it reads "tool_calls" when the model called tools.
    With `SamplingParams.n` > 1, `index` says which sample's reply (0..n-1) the chunk belongs to: a chunk
    never mixes replies, and each reply's own last chunk carries its finish reason.
    """

    text: str
    reasoning_text: str
    tool_calls: tuple[ToolCallDelta, ...]
    finish_reason: ChatFinishReason | None = None
    index: int = 0  # the sample (0..n-1) whose reply this is

    @property
    def empty(self) -> bool:
        """Nothing to send: no text, no reasoning, no call, not the last chunk."""
        return not (self.text or self.reasoning_text or self.tool_calls or self.finish_reason)


def new_call_id(rng: random.Random) -> str:
    """A fresh call id in OpenAI's shape; `rng` is injectable so tests can fix it."""
    return "call_" + "".join(rng.choices(_ID_ALPHABET, k=_ID_LENGTH))


def encode_arguments(arguments: dict[str, Any]) -> str:
    """The arguments text of a call: `json.dumps` defaults (`", "` and `": "`), non-ASCII kept as is.

    Every parser emits this form whatever spacing or escapes the model wrote, so the text a client
    receives does not depend on how the model formatted its JSON.
    """
    return json.dumps(arguments, ensure_ascii=False)


def merge_tool_call_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from a stream of deltas, in index order (what a client accumulating OpenAI deltas does)."""
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None:
            ids[delta.index] = delta.id
        if delta.name is not None:
            names[delta.index] = delta.name
        arguments.setdefault(delta.index, []).append(delta.arguments)
    return [ToolCall(ids[i], names[i], "".join(arguments[i])) for i in sorted(arguments)]
