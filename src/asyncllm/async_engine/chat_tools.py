"""A chat request's `tools` and `tool_choice`, checked and normalised: OpenAI function tools in, `ChatTools`
out. Every bad value raises `InvalidRequestError` naming its field. Cheap and plain Python (no template, no
grammar): runs in the caller's thread when the request is made.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asyncllm.errors import InvalidRequestError
from asyncllm.input_limits import check_tools_size
from asyncllm.structured import MAX_CONSTRAINT_CHARS
from asyncllm.validation import short_repr

ChoiceMode = Literal["auto", "none", "required", "named"]
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; it also keeps names literal inside JSON text
_CHOICES = "'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"


@dataclass(frozen=True, slots=True)
class ChatTools:
    """The tools a request offers (as given, for the template) and how it may use them.

    `mode`: "auto" (the model decides), "none" (no call: the prompt still lists the tools, as vLLM and
    OpenAI do, but the reply is neither constrained nor parsed for calls), "required" (one or more calls),
    "named" (exactly one call of `name`). `schemas`: (name, parameters schema as JSON text) per tool, in the
    request's order. `parallel`: a reply may make several calls.
    """

    tools: tuple[Mapping[str, Any], ...] = ()
    schemas: tuple[tuple[str, str], ...] = ()
    mode: ChoiceMode = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> bool:
        """The prompt lists the tools (whatever the mode: a model that sees the same tools on every turn of
        a conversation keeps its prompt's prefix, and its cached blocks, when one turn forbids calls)."""
        return bool(self.tools)

    @property
    def active(self) -> bool:
        """The request may call tools: the reply is constrained by their grammar and parsed for calls."""
        return bool(self.tools) and self.mode != "none"


def check_tools(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any], parallel_tool_calls: bool = True
) -> ChatTools:
    """`tools` (None or a list of `{"type": "function", "function": {"name", "description", "parameters"}}`),
    `tool_choice` and `parallel_tool_calls`, checked. A tool's `parameters` is a JSON schema of an object
    (`"type": "object"` is assumed when it names no type; no parameters: the call takes none)."""
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be a bool, got {short_repr(parallel_tool_calls)}")
    if tools is None:
        tools = ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"tools must be a list of function tools, got {type(tools).__name__}")
    check_tools_size(list(tools), MAX_CONSTRAINT_CHARS)  # before json.dumps recurses into a schema
    schemas = tuple(_check_tool(i, tool) for i, tool in enumerate(tools))
    names = [name for name, _ in schemas]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequestError(f"tools[{i}].function.name {name!r} is already the name of another tool")
    mode, chosen = _check_choice(tool_choice, names)
    return ChatTools(tuple(tools), schemas, mode, chosen, parallel_tool_calls)


def _check_tool(i: int, tool: Any) -> tuple[str, str]:
    if not isinstance(tool, Mapping):
        raise InvalidRequestError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise InvalidRequestError(f"tools[{i}].type must be 'function', got {short_repr(tool.get('type'))}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequestError(f"tools[{i}].function must be a dict, got {type(function).__name__}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {short_repr(name)}"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"tools[{i}].function.description must be a str, got {type(description).__name__}")
    return name, _schema_text(i, function.get("parameters"))


def _schema_text(i: int, parameters: Any) -> str:
    field = f"tools[{i}].function.parameters"
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(f"{field} must be a JSON schema (a dict), got {type(parameters).__name__}")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(f"{field} must describe an object (a call's arguments are one), got type {kind!r}")
    try:
        return json.dumps({"type": "object", **parameters}, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{field} is not serialisable as JSON: {e}") from None


def _check_choice(choice: Any, names: list[str]) -> tuple[ChoiceMode, str | None]:
    if choice in ("auto", "none", "required"):
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice='required' needs tools: the request offers none")
        return choice, None
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or not isinstance(function, Mapping):
        raise InvalidRequestError(f"tool_choice must be {_CHOICES}, got {short_repr(choice)}")
    name = function.get("name")
    if name not in names:
        offered = ", ".join(repr(n) for n in names) or "none"
        raise InvalidRequestError(
            f"tool_choice names the tool {short_repr(name)}, which tools do not offer ({offered})"
        )
    return "named", name
