"""Chat messages -> one prompt, through the model's own chat template (read from its tokenizer).

Owns message validation and the one subtlety of templated prompts: the template already writes the
special tokens (BOS, turn markers), so its text is encoded without adding them again. Plain Python: the
tokenizer is passed in; neither torch nor transformers is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, overload

from asyncllm.errors import InvalidRequestError, UnsupportedModelError

Message = Mapping[str, Any]  # {"role": "system" | "user" | "assistant", "content": str}


class ChatTokenizer(Protocol):
    """What chat templating needs of a tokenizer (a transformers fast tokenizer provides it)."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


@overload
def apply_chat_template(
    tokenizer: ChatTokenizer | None,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    tokenize: Literal[False] = False,
) -> str: ...


@overload
def apply_chat_template(
    tokenizer: ChatTokenizer | None,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    *,
    tokenize: Literal[True],
) -> list[int]: ...


def apply_chat_template(
    tokenizer: ChatTokenizer | None,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    tokenize: bool = False,
) -> str | list[int]:
    """The conversation as the model was trained to see it, ending with the assistant's turn opener.

    Returns the prompt text, or with `tokenize=True` its token ids: pass those to the engine when the
    template writes a BOS token that encoding the text would add a second time.
    """
    _check_messages(messages)
    if tokenizer is None:
        raise UnsupportedModelError("this model has no tokenizer, so it has no chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise UnsupportedModelError(
            "this model's tokenizer has no chat template (it is probably a base model, not an instruct "
            "one): format the prompt yourself, or use a model whose tokenizer defines `chat_template`"
        )
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert isinstance(text, str), type(text)
    if not tokenize:
        return text
    return list(tokenizer.encode(text, add_special_tokens=False))


def _check_messages(messages: Sequence[Message]) -> None:
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
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}]['content'] must be a str, got {type(content).__name__}")
