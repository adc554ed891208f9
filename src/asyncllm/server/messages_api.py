"""POST /v1/messages (Anthropic's Messages API) in, a chat completion request out: the one place where the
Messages request is translated, and where errors take Anthropic's shape.

`system` and `messages` (text, `tool_use`, `tool_result` and `thinking` blocks) become chat messages; tools
(`input_schema`), `tool_choice` (auto / any / tool / none), `stop_sequences`, `max_tokens`, `temperature`,
`top_p`, `top_k`, `thinking` (the template's `enable_thinking`) and `output_config.format` (a JSON schema)
become chat's fields; the chat pipeline
checks the rest, and its errors, naming chat's fields, are renamed to the Messages request's (`renamed`).
Knows nothing of the response's shape (`serving_messages`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

from asyncllm.server.errors import OpenAIError
from asyncllm.server.protocol import ChatCompletionRequest
from asyncllm.validation import short_repr

MAX_TEMPERATURE = 1.0  # Anthropic's bound

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

# Chat's field -> the Messages request's, for errors the chat pipeline raises.
_RENAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: a JSON schema the reply follows
    metadata: dict[str, Any] | None = None  # user_id: identifies the end user, changes nothing here
    service_tier: str | None = None
    # asyncllm's and vLLM's extras.
    seed: int | None = None
    priority: int | None = None
    timeout: float | None = None


def error_body(exc: OpenAIError) -> dict[str, Any]:
    """`exc` in Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}; the message
    names the field at fault (Anthropic's errors have no `param`)."""
    message = exc.message
    if exc.param is not None and exc.param not in message:
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(exc.status, "api_error"), "message": message}}


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


def to_chat(body: MessagesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request (the conversation, tools, and sampling fields under chat's names), and for each of its
    messages the Messages field it came from (for errors)."""
    if body.max_tokens < 1:
        raise OpenAIError(f"max_tokens={body.max_tokens} is invalid: at least 1", param="max_tokens")
    if body.temperature is not None and not 0.0 <= body.temperature <= MAX_TEMPERATURE:
        raise OpenAIError(f"temperature={body.temperature} is invalid: a number in [0, 1]", param="temperature")
    if body.service_tier not in (None, "auto", "standard_only"):
        raise OpenAIError(
            f"service_tier={short_repr(body.service_tier)}: only auto or standard_only", param="service_tier"
        )
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else _text(body.system, "system")
        messages.append({"role": "system", "content": system})
        origins.append("system")
    if not body.messages:
        raise OpenAIError("messages must hold at least one message", param="messages")
    for i, message in enumerate(body.messages):
        turn = _messages(message, f"messages[{i}]")
        messages += turn
        origins += [f"messages[{i}]"] * len(turn)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences or None,
        "stream": body.stream,
        "seed": body.seed,
        "priority": body.priority,
        "timeout": body.timeout,
    }
    if body.tools is not None:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"], parallel = _tool_choice(body.tool_choice)
        chat["parallel_tool_calls"] = parallel
    if body.output_config is not None:
        chat["response_format"] = _output_format(body.output_config)
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": _thinking(body.thinking, body.max_tokens)}
    try:
        return ChatCompletionRequest.model_validate(chat), origins
    except ValueError as exc:
        raise OpenAIError(f"messages: {exc}", param="messages") from None


def renamed(exc: OpenAIError, origins: list[str]) -> OpenAIError:
    """`exc` (naming chat's fields) naming the Messages request's: chat's messages[i] is the message (or
    `system`) it came from; max_completion_tokens is max_tokens, stop is stop_sequences."""
    param = exc.param
    if param is not None:
        match = re.match(r"messages\[(\d+)\]", param)
        if match is not None:
            index = int(match.group(1))
            origin = origins[index] if index < len(origins) else "messages"
            # A message of several blocks may be several chat messages: the rest of the path is chat's.
            param = origin + (param[match.end() :] if origin != "system" else "")
        param = re.sub(r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema", param)
        param = re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", param)
        param = _RENAMES.get(param, param)
    message = exc.message.replace("max_completion_tokens", "max_tokens").replace(
        "response_format", "output_config.format"
    )
    return OpenAIError(message, status=exc.status, type=exc.type, param=param, code=exc.code, headers=exc.headers)


def _messages(message: Any, at: str) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user turn's tool results each a tool message (before its
    text), an assistant turn's tool_use blocks its tool calls and its thinking its reasoning."""
    if not isinstance(message, dict):
        raise OpenAIError(f"{at} must be an object, got {short_repr(message)}", param=at)
    role, content = message.get("role"), message.get("content")
    unknown = set(message) - {"role", "content"}
    if unknown:
        raise OpenAIError(f"{at}: unknown field {sorted(unknown)[0]}", param=f"{at}.{sorted(unknown)[0]}")
    if role not in ("user", "assistant"):
        raise OpenAIError(f"{at}.role must be user or assistant, got {short_repr(role)}", param=f"{at}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise OpenAIError(f"{at}.content must be a string or a list of blocks", param=f"{at}.content")
    texts: list[str] = []
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    allowed = {"text", "tool_result"} if role == "user" else {"text", "tool_use", "thinking"}
    for j, block in enumerate(content):
        where = f"{at}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise OpenAIError(
                f"a {role} message's block of type {short_repr(kind)} is not supported: only "
                f"{', '.join(sorted(allowed))} blocks",
                param=f"{where}.type",
            )
        if kind == "text":
            texts.append(_field(block, "text", str, where))
        elif kind == "tool_result":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text(result, f"{where}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, where), "content": text})
        elif kind == "tool_use":
            arguments = json.dumps(_field(block, "input", dict, where), ensure_ascii=False)
            function = {"name": _field(block, "name", str, where), "arguments": arguments}
            calls.append({"id": _field(block, "id", str, where), "type": "function", "function": function})
        else:
            thinking.append(_field(block, "thinking", str, where))
    turn: list[dict[str, Any]] = list(results)
    if role == "user":
        if texts or not results:
            turn.append({"role": "user", "content": "".join(texts)})
        return turn
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        reply["tool_calls"] = calls
    if thinking:
        reply["reasoning_content"] = "".join(thinking)
    return [reply]


def _field(block: dict[str, Any], name: str, kind: type, at: str) -> Any:
    value = block.get(name)
    if not isinstance(value, kind):
        raise OpenAIError(
            f"{at}.{name} must be a {'string' if kind is str else 'JSON object'}, got {short_repr(value)}",
            param=f"{at}.{name}",
        )
    return value


def _text(blocks: list[Any], at: str) -> str:
    """Text blocks joined (`system`, a tool result's content)."""
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else block
            raise OpenAIError(
                f"block of type {short_repr(kind)} is not supported: only text blocks", param=f"{at}[{j}]"
            )
        texts.append(block["text"])
    return "".join(texts)


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """An Anthropic client tool ({name, description, input_schema}) as a chat function tool."""
    at = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise OpenAIError(f"{at} must be an object", param=at)
    if tool.get("type", "custom") != "custom":
        raise OpenAIError(
            f"{at}.type {short_repr(tool.get('type'))} is not supported: only client tools (name, input_schema)",
            param=f"{at}.type",
        )
    unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
    if unknown:
        raise OpenAIError(f"{at}: unknown field {sorted(unknown)[0]}", param=f"{at}.{sorted(unknown)[0]}")
    if "input_schema" not in tool:
        raise OpenAIError(f"{at}.input_schema is required", param=f"{at}.input_schema")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool]:
    """(chat's tool_choice, parallel calls allowed)."""
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise OpenAIError(
        "tool_choice must be {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or {'type': 'tool', 'name': ...}",
        param="tool_choice",
    )


def _output_format(config: dict[str, Any]) -> dict[str, Any] | None:
    """`output_config.format` ({"type": "json_schema", "schema": ...}) as chat's response_format."""
    unknown = {k for k, v in config.items() if v is not None} - {"format"}
    if unknown:
        name = sorted(unknown)[0]
        raise OpenAIError(
            f"output_config.{name} is not supported: only output_config.format", param=f"output_config.{name}"
        )
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise OpenAIError(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}", param="output_config.format"
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(thinking: dict[str, Any], max_tokens: int) -> bool:
    """`thinking` as the template's `enable_thinking`: enabled (or adaptive) or disabled. Its budget must be
    under max_tokens, as Anthropic requires; the reasoning is bounded by max_tokens only."""
    kind = thinking.get("type")
    if kind == "disabled":
        return False
    if kind not in ("enabled", "adaptive"):
        raise OpenAIError("thinking.type must be enabled, adaptive or disabled", param="thinking.type")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or not 0 < budget < max_tokens):
        raise OpenAIError(
            f"thinking.budget_tokens={short_repr(budget)} is invalid: a whole number under max_tokens",
            param="thinking.budget_tokens",
        )
    return True
