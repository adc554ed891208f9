"""Which parsers a model's output needs: the tool-call formats by name, and the choice for a model read from
its chat template (what the model was trained to write) or, without one, its architecture. Knows the
formats only by their markers; the parsers themselves live in their own modules."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from asyncllm.errors import InvalidConfigError
from asyncllm.parsing.hermes import HermesToolParser
from asyncllm.parsing.llama3_json import Llama3JsonToolParser
from asyncllm.parsing.mistral import MistralToolParser
from asyncllm.parsing.reasoning import ReasoningTags
from asyncllm.parsing.tool_parser import ToolParser

TOOL_PARSERS: Mapping[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

# Template markers, most specific first: a template that writes `<tool_call>` is Hermes-style whatever else
# it mentions. `<|start_header_id|>` is Llama 3's turn marker (3.0 templates lack the python tag).
_TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>", "llama3_json"),
)
_ARCHITECTURES = {
    "Qwen2ForCausalLM": "hermes",
    "Qwen2MoeForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
    "LlamaForCausalLM": "llama3_json",
    "MistralForCausalLM": "mistral",
}
_THINK = ReasoningTags()


@dataclass(frozen=True, slots=True)
class ParserChoice:
    """The parsers a model needs: a tool-call format (None: the model has no known one) and reasoning tags
    (None: it does not think out loud)."""

    tool_parser: str | None
    reasoning: ReasoningTags | None


def choose_parsers(chat_template: str | None, architecture: str | None = None) -> ParserChoice:
    """The parsers for a model, from its chat template text and, failing that, its HF architecture name.

    Tool calls: a template that writes `<tool_call>` => "hermes" (Qwen2/2.5/3, Hermes, QwQ); `[TOOL_CALLS]`
    => "mistral"; `<|python_tag|>` or Llama 3's `<|start_header_id|>` => "llama3_json". Without a template
    marker, Qwen2/Qwen3 architectures => "hermes", Llama => "llama3_json", Mistral => "mistral".
    Reasoning: a template that mentions `<think>` (Qwen3, QwQ, DeepSeek-R1 and its distills) => think tags.
    """
    template = chat_template or ""
    tool = next((name for marker, name in _TEMPLATE_MARKERS if marker in template), None)
    if tool is None and architecture is not None:
        tool = _ARCHITECTURES.get(architecture)
    reasoning = _THINK if _THINK.start in template else None
    return ParserChoice(tool, reasoning)


def make_tool_parser(name: str, rng: random.Random | None = None) -> ToolParser:
    """A fresh parser (one per reply) for the format `name`; `rng` draws the call ids."""
    try:
        parser = TOOL_PARSERS[name]
    except KeyError:
        raise InvalidConfigError(
            f"unknown tool-call format {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None
    return parser(rng)
