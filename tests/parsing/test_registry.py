"""Choosing parsers for a model from its chat template (or architecture), the registry of formats by name,
and the call-id shape."""

from __future__ import annotations

import random
import re

import pytest

from asyncllm.errors import InvalidConfigError
from asyncllm.parsing import (
    TOOL_PARSERS,
    ParserChoice,
    ReasoningTags,
    ToolCall,
    ToolCallDelta,
    choose_parsers,
    make_tool_parser,
    merge_tool_call_deltas,
    new_call_id,
)

THINK = ReasoningTags()
# The markers as the real templates write them (trimmed to the lines that matter).
QWEN3 = '{%- if tools %}<tools></tools>... <tool_call>\\n{"name": ...}</tool_call>{%- endif %}<think>\\n'
QWEN25 = '{{- \'<tool_call>\\n{"name": "\' }}{{ tool_call.name }}'
LLAMA31 = "<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
LLAMA30 = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
MISTRAL = "{{- '[TOOL_CALLS][' }}{%- for tool in message.tool_calls %}"
DEEPSEEK_R1 = "{{'<｜Assistant｜><think>\\n'}}"


@pytest.mark.parametrize(
    ("template", "architecture", "choice"),
    [
        (QWEN3, "Qwen3ForCausalLM", ParserChoice("hermes", THINK)),
        (QWEN25, "Qwen2ForCausalLM", ParserChoice("hermes", None)),
        (LLAMA31, "LlamaForCausalLM", ParserChoice("llama3_json", None)),
        (LLAMA30, None, ParserChoice("llama3_json", None)),
        (MISTRAL, "LlamaForCausalLM", ParserChoice("mistral", None)),  # the template wins
        (DEEPSEEK_R1, "Qwen2ForCausalLM", ParserChoice("hermes", THINK)),  # an R1 distill: Qwen's body
        (DEEPSEEK_R1, None, ParserChoice(None, THINK)),
        (None, "Qwen3MoeForCausalLM", ParserChoice("hermes", None)),
        (None, "MistralForCausalLM", ParserChoice("mistral", None)),
        (None, "GPT2LMHeadModel", ParserChoice(None, None)),
        (None, None, ParserChoice(None, None)),
    ],
)
def test_choose_parsers(template: str | None, architecture: str | None, choice: ParserChoice) -> None:
    assert choose_parsers(template, architecture) == choice


def test_every_name_makes_its_parser_and_an_unknown_one_is_refused_naming_the_known() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    for name in TOOL_PARSERS:
        assert make_tool_parser(name).name == name
    with pytest.raises(InvalidConfigError, match="hermes, llama3_json, mistral"):
        make_tool_parser("qwen3")


def test_call_ids_have_openais_shape_and_come_from_the_given_rng() -> None:
    ids = [new_call_id(random.Random(7)) for _ in range(2)]
    assert ids[0] == ids[1] and re.fullmatch(r"call_[A-Za-z0-9]{24}", ids[0])
    rng = random.Random(7)
    assert len({new_call_id(rng) for _ in range(1000)}) == 1000


def test_deltas_merge_like_an_openai_client_merges_them() -> None:
    deltas = [
        ToolCallDelta(1, "call_b", "g", ""),
        ToolCallDelta(0, "call_a", "f", '{"x": '),
        ToolCallDelta(1, None, None, "{}"),
        ToolCallDelta(0, None, None, "1}"),
    ]
    assert merge_tool_call_deltas(deltas) == [ToolCall("call_a", "f", '{"x": 1}'), ToolCall("call_b", "g", "{}")]
