"""OpenAI request fields asyncllm has no use for, accepted when null or when their value changes nothing.

Owns, for each such field, which values change nothing here and why the others cannot be honoured: a value
outside them is a 400 naming the field, never silently dropped. Identifiers and hints (`user`, `metadata`,
`safety_identifier`, `prompt_cache_key`, ...) are accepted whatever their value and are not listed here.
Knows nothing of sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from asyncllm.server.errors import OpenAIError
from asyncllm.validation import short_repr

Rule = tuple[Callable[[Any], bool], str]  # (the value changes nothing, why others are refused)


def _never(value: Any) -> bool:
    return False


CHAT_FIELDS: Mapping[str, Rule] = {
    "store": (lambda v: v is False, "only false: nothing is stored"),
    "service_tier": (lambda v: v in ("auto", "default"), "only 'auto' or 'default': one tier serves every request"),
    "reasoning_effort": (
        _never,
        "a model's reasoning is switched through its chat template instead "
        "(chat_template_kwargs, e.g. {'enable_thinking': false} for Qwen3)",
    ),
    "verbosity": (lambda v: v == "medium", "only 'medium' (the default): the model's replies are as it writes them"),
    "modalities": (lambda v: v == ["text"], "only ['text']: text is the only output"),
    "audio": (_never, "audio output is not supported"),
    "web_search_options": (_never, "web search is not supported"),
    "moderation": (_never, "moderation is not supported"),
    "functions": (lambda v: v == [], "deprecated by OpenAI: send tools instead"),
    "function_call": (lambda v: v in ("none", "auto"), "deprecated by OpenAI: send tool_choice instead"),
}

COMPLETION_FIELDS: Mapping[str, Rule] = {
    "suffix": (lambda v: v == "", "only '': insertion (text after the completion) is not supported"),
}


def check_neutral(request: BaseModel, rules: Mapping[str, Rule]) -> None:
    """400 naming the first field whose value is neither null nor one that changes nothing."""
    for name, (changes_nothing, why) in rules.items():
        value = getattr(request, name)
        if value is not None and not changes_nothing(value):
            raise OpenAIError(f"{name}={short_repr(value)} is not supported: {why}", param=name)
