"""The base of every tool-call format: what a parser is fed and gives back, and the rules all formats share.

Shared rules: a call is given out whole, as one delta carrying id, name and arguments, once its JSON has
closed and parsed (a name streamed earlier could not be taken back if the JSON then proved malformed); a
malformed call is plain content; whitespace next to a call is dropped, except that where content resumes
after calls the whitespace after the last call is kept to separate it from the content before them. A call
the token limit cut off (`finish(cut=True)`) is a call still, never its markup as content: with its name
and its arguments' JSON as far as it got (vLLM's answer for a cut-off forced call; the finish reason
"length" tells the client), or left out when the cut came before its name was whole. A format subclass
only finds where calls begin and end; it knows nothing of reasoning or of the server.
"""

from __future__ import annotations

import json
import random
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

from asyncllm.parsing.types import ToolCall, ToolCallDelta, encode_arguments, new_call_id


class ToolParse(NamedTuple):
    content: str
    calls: tuple[ToolCallDelta, ...]


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads would accept NaN and Infinity; the client would not


def load_json(text: str) -> Any:
    """Strict JSON, or None when `text` is not JSON (never raises)."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except ValueError:
        return None


def call_fields(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str] | None:
    """(name, arguments text) of a call object `{"name": ..., "arguments": {...}}`, or None if it is not one.

    Arguments may be missing (no arguments), an object, or a string holding an object's JSON (some models
    write them so); anything else makes the call malformed.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        args = load_json(args)
    if not isinstance(args, dict):
        return None
    return obj["name"], encode_arguments(args)


# A call object cut off after its name: `{"name": "...", "arguments": <what came of them>`.
_CUT_CALL = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*(.*))?', re.S
)


def cut_call(text: str) -> tuple[str, str] | None:
    """(name, arguments text as far as it got) of a call object the output ended inside, or None when its
    name is not whole."""
    match = _CUT_CALL.match(text)
    if match is None:
        return None
    name = load_json(f'"{match.group(1)}"')
    if not isinstance(name, str) or not name:
        return None
    return name, (match.group(2) or "").rstrip()


class ToolParser(ABC):
    """Feed the answer text in pieces, get (content, call deltas); `finish` flushes and `called` says
    whether the reply called a tool (its finish reason is then "tool_calls")."""

    name: ClassVar[str]  # the registry's name for this format

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.SystemRandom()
        self.calls: list[ToolCall] = []  # every call made so far
        self._content: list[str] = []  # given out by the next feed or finish
        self._deltas: list[ToolCallDelta] = []
        self._pending_space = ""  # whitespace whose fate waits on what follows it
        self._after_call = False  # the last thing seen was a call
        self._content_seen = False  # some non-whitespace content was given out
        self._cut = False  # the output ended at the token limit (set by `finish`)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> ToolParse:
        self._consume(text)
        return self._take()

    def finish(self, cut: bool = False) -> ToolParse:
        """The output ended; `cut`: by the token limit (a call left open is given out as far as it got)."""
        self._cut = cut
        self._consume_end()
        if not self._after_call:
            self._content.append(self._pending_space)
        self._pending_space = ""
        return self._take()

    @abstractmethod
    def _consume(self, text: str) -> None:
        """Scan `text`, calling `_text` and `_call` for what is decided and holding back the rest."""

    @abstractmethod
    def _consume_end(self) -> None:
        """The output ended: decide everything still held back."""

    def _text(self, text: str) -> None:
        """Plain content; whitespace next to a call is dropped unless it separates content from content."""
        core = text.strip()
        if not core:
            self._pending_space += text
            return
        lead = text[: len(text) - len(text.lstrip())]
        if not self._after_call or self._content_seen:  # after a call, `_pending_space` is what followed it
            self._content.append(self._pending_space + lead)
        self._content.append(core)
        self._content_seen = True
        self._pending_space = text[len(text.rstrip()) :]
        self._after_call = False

    def _call(self, name: str, arguments: str) -> None:
        call = ToolCall(new_call_id(self._rng), name, arguments)
        self._deltas.append(ToolCallDelta(len(self.calls), call.id, call.name, call.arguments))
        self.calls.append(call)
        self._pending_space = ""
        self._after_call = True

    def _open_call(self, body: str, raw: str, name: str | None = None) -> None:
        """A call the output ended inside (`body`: its JSON so far; `name`: known from outside the JSON): cut
        off by the token limit, a call as far as it got (or nothing, before its name); else `raw` is content."""
        if not self._cut:
            self._text(raw)
            return
        fields = (name, body.strip()) if name else cut_call(body)
        if fields is not None:
            self._call(*fields)

    def _call_or_text(self, obj: Any, raw: str) -> bool:
        """A call from a parsed call object, else `raw` as content; whether it was a call."""
        fields = call_fields(obj)
        if fields is None:
            self._text(raw)
            return False
        self._call(*fields)
        return True

    def _take(self) -> ToolParse:
        out = ToolParse("".join(self._content), tuple(self._deltas))
        self._content.clear()
        self._deltas.clear()
        return out
