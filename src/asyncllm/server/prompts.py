"""What the model reads: chat messages as the chat template takes them, or completion prompts.

Owns the shapes OpenAI allows (text content parts; which fields each role may carry; a prompt as a string,
token ids, or a batch of either) and refuses the rest with a 400 naming the field. The chat planning
(`engine.chat`'s) templates the messages; the engine tokenizes and checks lengths and ids.
"""

from __future__ import annotations

from typing import Any

from asyncllm.server.errors import OpenAIError
from asyncllm.server.protocol import ChatMessage, CompletionRequest
from asyncllm.validation import short_repr

Prompt = str | list[int]


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI's messages as chat templates read them: `developer` is the system role (as OpenAI treats it
    for models without one), content parts are joined into text, past tool calls keep OpenAI's shape, a
    tool message keeps its `tool_call_id`, and a past turn's reasoning travels as `reasoning_content` (the
    name Qwen3's template reads; templates without a place for it ignore it)."""
    if not messages:
        raise OpenAIError("messages must hold at least one message", param="messages")
    return [_for_template(m, i) for i, m in enumerate(messages)]


def _for_template(message: ChatMessage, index: int) -> dict[str, Any]:
    at = f"messages[{index}]"
    role = message.role
    _only_for(message, index, "tool_calls", "assistant")
    _only_for(message, index, "tool_call_id", "tool")
    for name in ("reasoning_content", "reasoning", "refusal"):
        _only_for(message, index, name, "assistant")
    for name, instead in (("audio", "send the transcript as content"), ("function_call", "send tool_calls")):
        if getattr(message, name) is not None:
            raise OpenAIError(f"{name} is not supported in messages: {instead}", param=f"{at}.{name}")
    content = _text_content(message, index)
    if message.refusal is not None:  # what OpenAI's model said instead of an answer: the turn's text
        if content is not None:
            raise OpenAIError("give content or refusal, not both", param=f"{at}.refusal")
        content = message.refusal
    if content is None and not (role == "assistant" and message.tool_calls):
        raise OpenAIError(
            "content is required (an assistant message may omit it when it has tool_calls)", param=f"{at}.content"
        )
    if role == "tool" and message.tool_call_id is None:
        raise OpenAIError("a tool message needs the tool_call_id of the call it answers", param=f"{at}.tool_call_id")
    plain: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if message.name is not None:  # templates that know participants' names render it
        plain["name"] = message.name
    if message.tool_calls:
        plain["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        plain["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:
        plain["reasoning_content"] = reasoning
    return plain


def _only_for(message: ChatMessage, index: int, name: str, role: str) -> None:
    if getattr(message, name) is not None and message.role != role:
        raise OpenAIError(f"only {role} messages carry {name}", param=f"messages[{index}].{name}")


def _text_content(message: ChatMessage, index: int) -> str | None:
    content = message.content
    if content is None or isinstance(content, str):
        return content
    param = f"messages[{index}].content"
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(
                f"content part of type {short_repr(part.get('type'))} is not supported: only text parts",
                param=f"{param}[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def completion_prompts(request: CompletionRequest) -> list[Prompt]:
    """A string, token ids, or a list of either (each its own choices, as OpenAI does)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise OpenAIError(
        "prompt must be a non-empty string, a list of token ids, or a list of strings or of token-id lists",
        param="prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
