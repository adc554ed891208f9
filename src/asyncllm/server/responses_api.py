"""POST /v1/responses (OpenAI's Responses API) in, a chat completion request out: the one place where the
Responses request is translated. `input` (a string, or message, `function_call`, `function_call_output` and
`reasoning` items) and `instructions` become chat messages; flat function tools, `tool_choice`, `text.format`,
`max_output_tokens`, `temperature` and `top_p` become chat's fields; the chat pipeline checks the rest. An
error the chat pipeline raises names chat's field: `renamed` gives it the Responses name.

Nothing is stored: `store` true and `previous_response_id` are refused with a 400 (send the conversation in
`input`). Knows nothing of the response's shape (`serving_responses`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncllm.server.errors import OpenAIError
from asyncllm.server.neutral_fields import Rule, check_neutral
from asyncllm.server.protocol import ChatCompletionRequest
from asyncllm.validation import short_repr


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    # Identifiers and hints: change nothing here whatever their value.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Accepted when null or neutral (`_NEUTRAL`).
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None
    conversation: Any = None
    prompt: Any = None
    # asyncllm's and vLLM's extras (the openai client sends them through `extra_body`).
    top_k: int | None = None
    seed: int | None = None
    priority: int | None = None
    timeout: float | None = None


_NEUTRAL: dict[str, Rule] = {
    "store": (lambda v: v is False, "only false: nothing is stored (send the whole conversation in input)"),
    "previous_response_id": (
        lambda v: False,
        "responses are not stored: send the whole conversation in input (the output items of the previous "
        "response, then the new ones)",
    ),
    "service_tier": (lambda v: v in ("auto", "default"), "only 'auto' or 'default': one tier serves every request"),
    "truncation": (lambda v: v == "disabled", "only 'disabled': an input too long is a 400, never cut"),
    "include": (lambda v: v == [], "nothing more can be included"),
    "background": (lambda v: v is False, "only false: responses run in the foreground"),
    "top_logprobs": (lambda v: v == 0, "logprobs are not offered on /v1/responses (use /v1/chat/completions)"),
    "max_tool_calls": (lambda v: False, "not supported: parallel_tool_calls=false allows one call"),
    "stream_options": (lambda v: v == {} or set(v) <= {"include_obfuscation"}, "only include_obfuscation"),
    "conversation": (lambda v: False, "conversations are not stored: send the whole conversation in input"),
    "prompt": (lambda v: False, "stored prompt templates are not supported: send instructions and input"),
    "reasoning": (
        lambda v: not {k for k, x in v.items() if x is not None} - {"summary", "generate_summary"},
        "a model's reasoning is switched through its chat template; reasoning.effort is not supported",
    ),
}
# Chat's field name -> the Responses name, for errors the chat pipeline raises.
_RENAMES = (
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
)


def to_chat(body: ResponsesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request, and for each of its messages the Responses field it came from (for errors)."""
    check_neutral(body, _NEUTRAL)
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        origins.append("instructions")
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        _add_item(messages, origins, item, "input" if isinstance(body.input, str) else f"input[{i}]")
    if messages and "pending_reasoning" in messages[-1]:  # reasoning no assistant turn follows: nothing to render
        messages.pop()
        origins.pop()
    if not messages:
        raise OpenAIError("input must hold at least one item", param="input")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
        "top_k": body.top_k,
        "seed": body.seed,
        "priority": body.priority,
        "timeout": body.timeout,
    }
    if body.tools is not None:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = _response_format(body.text.format)
    try:
        return ChatCompletionRequest.model_validate(chat), origins
    except ValueError as exc:  # a message item whose fields chat's model refuses
        raise OpenAIError(f"input: {exc}", param="input") from None


def renamed(exc: OpenAIError, origins: list[str]) -> OpenAIError:
    """`exc` (raised naming chat's fields) naming the Responses request's: messages[i] -> its input item."""
    param = exc.param
    if param is not None:
        match = re.match(r"messages(?:\[(\d+)\])?", param)
        if match is not None:
            index = int(match.group(1)) if match.group(1) is not None else None
            origin = origins[index] if index is not None and index < len(origins) else "input"
            param = origin + param[match.end() :]
        for pattern, name in _RENAMES:
            param = pattern.sub(name, param)
    message = exc.message.replace("max_completion_tokens", "max_output_tokens").replace(
        "response_format", "text.format"
    )
    return OpenAIError(message, status=exc.status, type=exc.type, param=param, code=exc.code, headers=exc.headers)


def _add_item(messages: list[dict[str, Any]], origins: list[str], item: Any, at: str) -> None:
    """One input item as a chat message (a function call joins the assistant turn before it; a reasoning
    item waits, as `pending_reasoning`, for the assistant turn that follows it)."""
    if not isinstance(item, dict):
        raise OpenAIError(f"{at} must be an object, got {short_repr(item)}", param=at)
    kind = item.get("type", "message")
    last = messages[-1] if messages else None
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise OpenAIError(f"{at}.role must be user, assistant, system or developer", param=f"{at}.role")
        message: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{at}.content")}
    elif kind == "function_call":
        function = {"name": _str(item, "name", at), "arguments": _str(item, "arguments", at)}
        call = {"id": _str(item, "call_id", at), "type": "function", "function": function}
        if last is not None and last["role"] == "assistant" and "pending_reasoning" not in last:
            last.setdefault("tool_calls", []).append(call)  # the calls of one turn: one assistant message
            return
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text(output, f"{at}.output")
        message = {"role": "tool", "tool_call_id": _str(item, "call_id", at), "content": content}
    elif kind == "reasoning":
        texts = [part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict)]
        messages.append({"role": "reasoning", "pending_reasoning": "".join(texts)})
        origins.append(at)
        return
    else:
        raise OpenAIError(
            f"{at}.type {short_repr(kind)} is not supported: only message, function_call, function_call_output "
            "and reasoning items",
            param=f"{at}.type",
        )
    if last is not None and "pending_reasoning" in last:
        messages.pop()
        origins.pop()
        if message["role"] == "assistant":  # a past turn's reasoning: the template renders it (or leaves it out)
            message["reasoning_content"] = last["pending_reasoning"]
    messages.append(message)
    origins.append(at)


def _str(item: dict[str, Any], name: str, at: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise OpenAIError(f"{at}.{name} must be a string, got {short_repr(value)}", param=f"{at}.{name}")
    return value


def _text(content: Any, at: str) -> str:
    """A string, or text parts (input_text, output_text; text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{at} must be a string or a list of text parts, got {short_repr(content)}", param=at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise OpenAIError(
                f"content part of type {short_repr(kind)} is not supported: only input_text and output_text",
                param=f"{at}[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """A Responses function tool (flat: type, name, description, parameters, strict) as chat's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise OpenAIError(
            f"tools[{i}].type {short_repr(kind)} is not supported: only function tools", param=f"tools[{i}].type"
        )
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise OpenAIError(f"tools[{i}]: unknown field {sorted(unknown)[0]}", param=f"tools[{i}].{sorted(unknown)[0]}")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: chat's own
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}", param="tool_choice"
    )


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None or fmt.name is None:
        raise OpenAIError("text.format of type json_schema needs name and schema", param="text.format")
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}
