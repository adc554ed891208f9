"""Chat messages (and the tools a request offers) -> one prompt, through the model's own chat template (read
from its tokenizer, or one the caller gives).

Owns message validation, the shape templates expect for past tool calls (arguments as an object, not JSON
text), and the one subtlety of templated prompts: the template already writes the special tokens (BOS, turn
markers), so its text is encoded without adding them again. Plain Python: the tokenizer is passed in;
neither torch nor transformers is imported here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, overload

from asyncllm.errors import InvalidRequestError, UnsupportedModelError

# {"role": "system" | "user" | "assistant" | "tool", "content": str}; an assistant message that called tools
# has "tool_calls" (OpenAI's shape) and may have no content; a "tool" message answers one call.
Message = Mapping[str, Any]


class ChatTokenizer(Protocol):
    """What chat templating needs of a tokenizer (a transformers fast tokenizer provides it)."""

    chat_template: str | dict[str, str] | None

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


@overload
def apply_chat_template(
    tokenizer: ChatTokenizer | None,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    tokenize: Literal[False] = False,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str: ...


@overload
def apply_chat_template(
    tokenizer: ChatTokenizer | None,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    *,
    tokenize: Literal[True],
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]: ...


def apply_chat_template(
    tokenizer: ChatTokenizer | None,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    tokenize: bool = False,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str | list[int]:
    """The conversation as the model was trained to see it, ending with the assistant's turn opener.

    Returns the prompt text, or with `tokenize=True` its token ids: pass those to the engine when the
    template writes a BOS token that encoding the text would add a second time. `tools` (OpenAI function
    tools, already checked) reach the template as its `tools` variable; `chat_template` replaces the
    model's template; `template_kwargs` are more template variables (Qwen3's `enable_thinking`, say).
    """
    check_messages(messages)
    check_template_kwargs(template_kwargs)
    template = template_of(tokenizer, chat_template, with_tools=bool(tools))
    assert tokenizer is not None
    text = tokenizer.apply_chat_template(
        [_for_template(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **dict(template_kwargs or {}),
    )
    assert isinstance(text, str), type(text)
    if not tokenize:
        return text
    return list(tokenizer.encode(text, add_special_tokens=False))


def template_of(tokenizer: ChatTokenizer | None, chat_template: str | None = None, *, with_tools: bool = False) -> str:
    """The template a conversation goes through: `chat_template` if given, else the tokenizer's own (of a
    tokenizer with named templates, "tool_use" when the request offers tools and it has one, else "default")."""
    if tokenizer is None:
        raise UnsupportedModelError("this model has no tokenizer, so it has no chat template")
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise InvalidRequestError(f"chat_template must be a non-empty str, got {chat_template!r}")
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("tool_use" if with_tools and "tool_use" in template else "default")
    if not template or not isinstance(template, str):
        raise UnsupportedModelError(
            "this model's tokenizer has no chat template (it is probably a base model, not an instruct "
            "one): format the prompt yourself, pass a `chat_template`, or use a model whose tokenizer "
            "defines one"
        )
    return template


# `apply_chat_template`'s own arguments (transformers 4.4x-5.x): as template variables they would collide
# with them or change what it returns.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def check_template_kwargs(template_kwargs: Mapping[str, Any] | None) -> None:
    """`InvalidRequestError` unless `template_kwargs` is None or a dict of variable names (Qwen3's
    `enable_thinking`, say) that are not `apply_chat_template`'s own arguments."""
    if template_kwargs is None:
        return
    if not isinstance(template_kwargs, Mapping):
        raise InvalidRequestError(f"chat_template_kwargs must be a dict, got {type(template_kwargs).__name__}")
    for key in template_kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidRequestError(f"chat_template_kwargs: {key!r} is not a template variable name")
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(
                f"chat_template_kwargs: {key!r} is an argument of the templating itself, not a template variable"
            )


def check_messages(messages: Sequence[Message]) -> None:
    """`InvalidRequestError` naming the first bad message field; cheap (no template, no tokenizer)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(
            f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}]['role'] must be a non-empty str, got {role!r}")
        calls = message.get("tool_calls")
        if calls is not None and (isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence)):
            raise InvalidRequestError(f"messages[{i}]['tool_calls'] must be a list, got {type(calls).__name__}")
        if not isinstance(content, str) and not (content is None and calls):
            raise InvalidRequestError(f"messages[{i}]['content'] must be a str, got {type(content).__name__}")


def _for_template(message: Message) -> dict[str, Any]:
    """A copy of `message` as templates expect it: no content is "", and a past call's arguments are an
    object (OpenAI sends them as JSON text; templates write them with `tojson`, which would quote it)."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [_call_for_template(c) for c in out["tool_calls"]]
    return out


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    arguments = function["arguments"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call  # not JSON: the template writes it as it came
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}
