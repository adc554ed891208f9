"""What the model reads: chat messages through the checkpoint's chat template, or completion prompts.

Owns the shapes OpenAI allows (text content parts; a prompt as a string, token ids, or a batch of either)
and refuses the rest with a 400 naming the field. The engine tokenizes and checks lengths and ids.
"""

from __future__ import annotations

from typing import Any

from asyncllm import AsyncLLMEngine
from asyncllm.errors import InvalidRequestError, UnsupportedModelError
from asyncllm.server.errors import OpenAIError, invalid_request
from asyncllm.server.protocol import ChatMessage, CompletionRequest

Prompt = str | list[int]


def chat_prompt(engine: AsyncLLMEngine, messages: list[ChatMessage]) -> list[int]:
    """The conversation as token ids, ending with the assistant's turn opener."""
    if not messages:
        raise OpenAIError("messages must hold at least one message", param="messages")
    plain = [_plain(m, i) for i, m in enumerate(messages)]
    try:
        return engine.apply_chat_template(plain)
    except UnsupportedModelError as exc:  # e.g. a base model without a chat template
        raise OpenAIError(f"{exc}; use /v1/completions with a prompt instead", param="messages") from None
    except InvalidRequestError as exc:
        raise invalid_request(exc, param="messages") from None


def _plain(message: ChatMessage, index: int) -> dict[str, str]:
    plain = {"role": message.role, "content": _text_content(message, index)}
    if message.name is not None:  # templates that know participants' names render it
        plain["name"] = message.name
    return plain


def _text_content(message: ChatMessage, index: int) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    param = f"messages[{index}].content"
    if content is None:
        raise OpenAIError("content is required (tool calls are not supported)", param=param)
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(
                f"content part of type {part.get('type')!r} is not supported: only text parts", param=f"{param}[{j}]"
            )
        texts.append(part["text"])
    return "".join(texts)


def completion_prompts(request: CompletionRequest) -> list[Prompt]:
    """A string, token ids, or a list of either (each its own choices, as OpenAI does)."""
    if request.echo:
        raise OpenAIError("echo is not supported", param="echo")
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
