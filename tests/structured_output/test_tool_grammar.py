"""Tool-call grammars: each format's valid calls are accepted and every other call refused; the text compiles
again from itself; and random token walks under the grammar's mask (the tiny models' tokenizer, any seed)
always give replies the format's parser reads as calls whose arguments satisfy their tool's schema."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from asyncllm.errors import InvalidRequestError
from asyncllm.parsing import ChatStreamParser, ReasoningParser, encode_arguments, make_tool_parser
from asyncllm.structured_output.tool_grammar import ReasoningStart, ToolGrammarSpec, tool_grammar
from tests.fixtures.tiny_models import EOS_TOKEN, build_tokenizer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 10},
        "limit": {"type": "integer", "minimum": 1, "maximum": 5},
        "filters": {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
                "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]},
            },
            "required": ["tags", "value"],
        },
    },
    "required": ["query", "limit", "filters"],
}
SCHEMAS = {"weather": WEATHER, "search": SEARCH}
TOOLS = tuple((name, json.dumps(schema)) for name, schema in SCHEMAS.items())
GOOD_ARGS = {
    "weather": {"city": "Paris", "unit": "c"},
    "search": {"query": "q", "limit": 2, "filters": {"tags": ["a"], "value": 7}},
}
BAD_ARGS = {
    "weather": {"city": "Paris", "unit": "k"},
    "search": {"query": "q", "limit": 9, "filters": {"tags": ["a"], "value": 7}},
}
FORMATS = ("hermes", "llama3_json", "mistral")


def call_text(fmt: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls written as the format (and its grammar) writes them."""
    if fmt == "hermes":
        return "\n".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {encode_arguments(a)}}}\n</tool_call>' for n, a in calls
        )
    if fmt == "llama3_json":
        return "; ".join(f'{{"name": "{n}", "parameters": {encode_arguments(a)}}}' for n, a in calls)
    return "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {encode_arguments(a)}}}' for n, a in calls) + "]"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> xgr.GrammarCompiler:
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos])
    return xgr.GrammarCompiler(info)


def accepts(compiler: xgr.GrammarCompiler, grammar: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_accepts_one_or_more_calls_and_nothing_else(compiler: xgr.GrammarCompiler, fmt: str) -> None:
    grammar = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "required"))
    one = [("weather", GOOD_ARGS["weather"])]
    both = [("search", GOOD_ARGS["search"]), ("weather", GOOD_ARGS["weather"])]
    assert accepts(compiler, grammar, call_text(fmt, one))
    assert accepts(compiler, grammar, call_text(fmt, both))
    assert not accepts(compiler, grammar, "")
    assert not accepts(compiler, grammar, "Sure! " + call_text(fmt, one))
    assert not accepts(compiler, grammar, call_text(fmt, [("lookup", GOOD_ARGS["weather"])]))  # unknown tool
    for name in SCHEMAS:  # arguments outside the schema
        assert not accepts(compiler, grammar, call_text(fmt, [(name, BAD_ARGS[name])]))
    spaced = call_text(fmt, one).replace('"city": ', '"city":  ')  # free whitespace is not allowed
    assert not accepts(compiler, grammar, spaced)


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_parallel_calls_a_reply_makes_one(compiler: xgr.GrammarCompiler, fmt: str) -> None:
    one, two = [("weather", GOOD_ARGS["weather"])], [("weather", GOOD_ARGS["weather"])] * 2
    required = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "required", parallel=False))
    assert accepts(compiler, required, call_text(fmt, one))
    assert not accepts(compiler, required, call_text(fmt, two))
    auto = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "auto", parallel=False))
    assert accepts(compiler, auto, call_text(fmt, one))
    assert not accepts(compiler, auto, call_text(fmt, two))
    if fmt != "llama3_json":  # text may come before the call, not after it
        assert accepts(compiler, auto, "Checking. " + call_text(fmt, one))
        assert not accepts(compiler, auto, call_text(fmt, one) + " Done.")
        assert not accepts(compiler, auto, call_text(fmt, one) + "\n" + call_text(fmt, one))


@pytest.mark.parametrize("fmt", FORMATS)
def test_named_accepts_exactly_one_call_of_that_tool(compiler: xgr.GrammarCompiler, fmt: str) -> None:
    grammar = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "named", "search"))
    assert accepts(compiler, grammar, call_text(fmt, [("search", GOOD_ARGS["search"])]))
    assert not accepts(compiler, grammar, call_text(fmt, [("weather", GOOD_ARGS["weather"])]))
    assert not accepts(compiler, grammar, call_text(fmt, [("search", GOOD_ARGS["search"])] * 2))
    assert not accepts(compiler, grammar, call_text(fmt, [("search", BAD_ARGS["search"])]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_allows_text_and_constrains_a_call_once_it_opens(compiler: xgr.GrammarCompiler, fmt: str) -> None:
    grammar = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "auto"))
    good, bad = [("weather", GOOD_ARGS["weather"])], [("weather", BAD_ARGS["weather"])]
    assert accepts(compiler, grammar, "The weather is fine, no tool needed.")
    assert accepts(compiler, grammar, "")
    assert accepts(compiler, grammar, call_text(fmt, good))
    assert not accepts(compiler, grammar, call_text(fmt, bad))
    assert not accepts(compiler, grammar, call_text(fmt, [("lookup", GOOD_ARGS["weather"])]))
    if fmt == "llama3_json":  # calls only open the reply: text may not start with `{`
        assert not accepts(compiler, grammar, '  {"name": "weather"}')
    else:  # calls may follow text, and text may follow calls
        assert accepts(compiler, grammar, "Let me check. " + call_text(fmt, good) + " Done.")
        assert not accepts(compiler, grammar, "Let me check. " + call_text(fmt, bad))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reasoning_comes_first_when_the_model_thinks(compiler: xgr.GrammarCompiler, fmt: str) -> None:
    call = call_text(fmt, [("weather", GOOD_ARGS["weather"])])
    opened = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "required", reasoning=ReasoningStart.OPEN))
    assert accepts(compiler, opened, "The user wants weather.</think>\n\n" + call)
    assert not accepts(compiler, opened, call)  # the block the prompt opened must close first
    optional = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "required", reasoning=ReasoningStart.OPTIONAL))
    assert accepts(compiler, optional, "<think>hm <tool_call></think>" + call)
    assert accepts(compiler, optional, call)
    auto = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "auto", reasoning=ReasoningStart.OPEN))
    assert accepts(compiler, auto, "still thinking, maybe [TOOL_CALLS] or <tool_call> {")  # may end inside
    assert not accepts(compiler, auto, "done</think>" + call_text(fmt, [("weather", BAD_ARGS["weather"])]))
    auto_optional = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "auto", reasoning=ReasoningStart.OPTIONAL))
    assert not accepts(compiler, auto_optional, "Hello <think>")  # a block opens the reply or not at all


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_the_text_compiles_again_from_itself(fmt: str, choice: Any) -> None:
    for start in ReasoningStart:
        spec = ToolGrammarSpec(TOOLS, fmt, choice, "weather" if choice == "named" else None, start)
        text = tool_grammar(spec)
        assert str(xgr.Grammar.from_ebnf(text)) == text
        assert tool_grammar(spec) is text  # cached


def test_a_schema_that_does_not_compile_names_its_tool() -> None:
    tools = (
        *TOOLS,
        ("broken", json.dumps({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}})),
    )
    with pytest.raises(InvalidRequestError, match=r"tools\[2\]\.function\.parameters .*parenthesis") as info:
        tool_grammar(ToolGrammarSpec(tools, "hermes", "required"))
    assert "/project/" not in str(info.value)


def walk(compiler: xgr.GrammarCompiler, tokenizer: Any, grammar: str, rng: random.Random, prefix: str = "") -> str:
    """A reply drawn uniformly among the tokens the grammar allows at each step (what a random model does
    under the mask), after `prefix`, until the stop token or 2,000 tokens."""
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    assert matcher.accept_string(prefix)
    vocab = len(tokenizer)
    bitmask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    ids: list[int] = []
    for _ in range(2000):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab])
        token = int(rng.choice(allowed))
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
        ids.append(token)
    return prefix + tokenizer.decode(ids)


def parse(fmt: str, text: str, reasoning: ReasoningParser | None = None) -> tuple[str, str, list[Any]]:
    parser = ChatStreamParser(reasoning, make_tool_parser(fmt, random.Random(0)))
    first, last = parser.feed(text), parser.finish("stop")
    return first.text + last.text, first.reasoning_text + last.reasoning_text, parser.tool_calls


def check_calls(calls: list[Any], names: set[str]) -> None:
    for call in calls:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_walks_under_a_forced_grammar_always_parse(compiler: Any, tokenizer: Any, fmt: str) -> None:
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    required = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "required"))
    named = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "named", "search"))
    for _ in range(6):
        text = walk(compiler, tokenizer, required, rng)
        content, _, calls = parse(fmt, text)
        assert calls and not content.strip(), (seed, text)
        check_calls(calls, set(SCHEMAS))
        text = walk(compiler, tokenizer, named, rng)
        content, _, calls = parse(fmt, text)
        assert [c.name for c in calls] == ["search"] and not content.strip(), (seed, text)
        check_calls(calls, {"search"})


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_walks_after_an_auto_call_opens_parse(compiler: Any, tokenizer: Any, fmt: str) -> None:
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    grammar = tool_grammar(ToolGrammarSpec(TOOLS, fmt, "auto"))
    opener = {"hermes": "Checking. <tool_call>", "llama3_json": "{", "mistral": "Checking. [TOOL_CALLS]"}[fmt]
    for _ in range(4):
        text = walk(compiler, tokenizer, grammar, rng, prefix=opener)
        _, _, calls = parse(fmt, text)
        assert calls, (seed, text)
        check_calls(calls, set(SCHEMAS))


def test_random_walks_reason_then_call(compiler: Any, tokenizer: Any) -> None:
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    grammar = tool_grammar(ToolGrammarSpec(TOOLS, "hermes", "required", reasoning=ReasoningStart.OPEN))
    for _ in range(4):
        text = walk(compiler, tokenizer, grammar, rng, prefix="The user wants the weather.</think>")
        content, reasoning, calls = parse("hermes", text, ReasoningParser(start_in_reasoning=True))
        assert reasoning == "The user wants the weather." and calls and not content.strip(), (seed, text)
        check_calls(calls, set(SCHEMAS))
