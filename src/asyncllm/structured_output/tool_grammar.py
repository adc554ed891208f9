"""The grammar that makes a chat reply's tool calls parse: EBNF text, built with xgrammar's structural tags,
for a tool-call format (the names `asyncllm.parsing` gives them) and a tool choice.

"required": one or more calls (one without parallel calls) and nothing else; "named": exactly one call of
that tool; "auto": free text, but once a call opens (the format's marker) the rest of it is the format's
call with arguments that satisfy the tool's parameter schema. A thinking model may reason first (see
`ReasoningStart`). Arguments are JSON without free whitespace (`, ` and `: `, as the parsers re-encode
them). The text travels as `SamplingParams(grammar=...)` and compiles where every grammar compiles. Knows
the formats only as text: nothing of parsers, requests or the engine.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    Format,
    GrammarFormat,
    OptionalFormat,
    OrFormat,
    RegexFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from asyncllm.errors import InvalidRequestError

Choice = Literal["auto", "required", "named"]
_XGRAMMAR_PLACE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[15:38:14] /project/cpp/x.cc:94: " before the reason
_WHITESPACE = "[ \\t\\r\\n]"
# String characters as xgrammar 0.2.9 prints them: a length-bounded string's admit raw control characters
# (JSON forbids them, and so do the parsers), and both admit UTF-8-encoded surrogates (invalid UTF-8: they
# decode to three U+FFFD each, and a bounded string then outgrows its bound). Both are narrowed.
_STRING_CHARS = r"[^\0-\x1f\"\\\r\n"  # the start of a class, closed by `]` or followed by more exclusions
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_NO_SURROGATES = r"\ud800-\udfff"
_AFTER_REASONING = "\\n{0,2}"  # Qwen3 and DeepSeek-R1 write `</think>\n\n`; the reasoning parser drops them


@dataclass(frozen=True, slots=True)
class _Format:
    """How one format writes its calls: `call_head + name + call_mid`, the arguments, `call_end`; several
    calls joined by `separator`, the whole list between `list_begin` and `list_end`; `trigger` opens calls
    in free text (None: calls only open the reply)."""

    call_head: str
    call_mid: str
    call_end: str
    separator: str
    list_begin: str = ""
    list_end: str = ""
    trigger: str | None = None


FORMATS: dict[str, _Format] = {
    # `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, a line apart: Qwen2.5/3's template
    "hermes": _Format('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", trigger="<tool_call>"),
    # The whole reply is `{"name": ..., "parameters": {...}}`, several joined by `;` (the parser's rule).
    "llama3_json": _Format('{"name": "', '", "parameters": ', "}", "; "),
    # `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker spelt as text: see the docs).
    "mistral": _Format('{"name": "', '", "arguments": ', "}", ", ", "[TOOL_CALLS][", "]", trigger="[TOOL_CALLS]"),
}


class ReasoningStart(enum.Enum):
    """Where a thinking model's reasoning block stands when the reply starts."""

    NONE = "none"  # the model does not reason (or has no tags): the calls grammar applies from the start
    OPEN = "open"  # the prompt opened the block: the reply reasons until the end tag, then the grammar applies
    OPTIONAL = "optional"  # the reply may open with a whole block first (the start tag nowhere else)


@dataclass(frozen=True, slots=True)
class ToolGrammarSpec:
    """What a tool-call grammar depends on (hashable: grammars are cached by it).

    `tools`: (name, parameters schema as JSON text) for every tool of the request, in its order (an error
    names a tool by its index there); `name`: the tool a "named" choice calls; `parallel`: whether a reply
    may make several calls ("named" makes one); `think`: the model's (start, end) reasoning tags, used
    unless `reasoning` is NONE.
    """

    tools: tuple[tuple[str, str], ...]
    format: str
    choice: Choice
    name: str | None = None
    parallel: bool = True
    reasoning: ReasoningStart = ReasoningStart.NONE
    think: tuple[str, str] = ("<think>", "</think>")


def tool_grammar(spec: ToolGrammarSpec) -> str:
    """The grammar text for `spec`; `InvalidRequestError` names the tool whose parameters do not compile.
    Built once per spec (a small JSON schema takes about a millisecond), then served from a cache."""
    return _cached(spec)


@functools.lru_cache(maxsize=256)
def _cached(spec: ToolGrammarSpec) -> str:
    fmt = FORMATS[spec.format]
    indices = [i for i, (name, _) in enumerate(spec.tools) if spec.choice != "named" or name == spec.name]
    assert indices, f"no tool named {spec.name!r}"
    calls = [_call(fmt, spec.tools[i][0], _arguments(i, spec.tools[i][1])) for i in indices]
    think_start, think_end = spec.think
    free_excludes = [think_start] if spec.reasoning is ReasoningStart.OPTIONAL else []
    content: Format
    if spec.choice == "auto":
        content = _auto(fmt, calls, spec.parallel, free_excludes)
    else:
        content = _wrapped(fmt, _calls(fmt, calls, spec.parallel and spec.choice == "required"))
    grammar = _with_reasoning(content, spec.reasoning, think_start, think_end, free=spec.choice == "auto")
    text = str(xgr.Grammar.from_structural_tag(StructuralTag(format=grammar)))
    # Printed as the EBNF parser prints it (a first print may still hold an empty `""` it would drop), so
    # compiling the text and printing it again gives the text back.
    return str(xgr.Grammar.from_ebnf(text))


def _arguments(index: int, schema: str) -> GrammarFormat:
    try:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError) as e:  # xgrammar's errors name the problem; InvalidJSONError is a ValueError
        reason = _XGRAMMAR_PLACE.sub("", str(e)).strip()
        raise InvalidRequestError(
            f"tools[{index}].function.parameters is not a JSON schema asyncllm can use: {reason}"
        ) from e
    text = str(grammar).replace(_STRING_CHARS, _STRING_CHARS + _NO_SURROGATES)
    return GrammarFormat(grammar=text.replace(_BOUNDED_STRING_CHAR, _STRING_CHARS + _NO_SURROGATES + "]"))


def _call(fmt: _Format, name: str, arguments: GrammarFormat) -> TagFormat:
    return TagFormat(begin=fmt.call_head + name + fmt.call_mid, content=arguments, end=fmt.call_end)


def _calls(fmt: _Format, calls: Sequence[TagFormat], parallel: bool) -> Format:
    """One call of any of `calls`, or with `parallel` one or more joined by the format's separator."""
    if parallel:
        return TagsWithSeparatorFormat(tags=list(calls), separator=fmt.separator, at_least_one=True)
    return calls[0] if len(calls) == 1 else OrFormat(elements=list(calls))


def _wrapped(fmt: _Format, calls: Format) -> Format:
    return _listed(fmt, calls) if fmt.list_begin else calls


def _listed(fmt: _Format, calls: Format) -> TagFormat:
    return TagFormat(begin=fmt.list_begin, content=calls, end=fmt.list_end)


def _auto(fmt: _Format, calls: Sequence[TagFormat], parallel: bool, excludes: list[str]) -> Format:
    if fmt.trigger is not None:
        # Free text; from the trigger on, a call (or the format's list of calls), then free text again (once
        # more calls may open), or the end of the reply (without `parallel`).
        tags = list(calls) if not fmt.list_begin else [_listed(fmt, _calls(fmt, calls, parallel))]
        return TriggeredTagsFormat(triggers=[fmt.trigger], tags=tags, excludes=excludes, stop_after_first=not parallel)
    # Calls open the reply or not at all (the parser's rule): a reply that does not start with `{` is text,
    # and text may not start with `{` (nor, when a reasoning block may open the reply, with `<`).
    first = "[^{<" if excludes else "[^{"
    text = SequenceFormat(
        elements=[RegexFormat(pattern=f"{_WHITESPACE}*{first} \\t\\r\\n]"), AnyTextFormat(excludes=excludes)]
    )
    return OrFormat(elements=[_calls(fmt, calls, parallel), RegexFormat(pattern=f"{_WHITESPACE}*"), text])


def _with_reasoning(content: Format, start: ReasoningStart, think_start: str, think_end: str, free: bool) -> Format:
    """`content` after the reasoning block `start` calls for. With `free` (the "auto" choice) a reply whose
    block the prompt opened may also end inside it, as it could without tools."""
    if start is ReasoningStart.NONE:
        return content
    after = RegexFormat(pattern=_AFTER_REASONING)
    if start is ReasoningStart.OPTIONAL:
        block = TagFormat(begin=think_start, content=AnyTextFormat(), end=think_end)
        return SequenceFormat(elements=[OptionalFormat(content=SequenceFormat(elements=[block, after])), content])
    closed = SequenceFormat(elements=[TagFormat(begin="", content=AnyTextFormat(), end=think_end), after, content])
    if not free:
        return closed
    # The open branch dies at the end tag, so after it only `closed` is alive and calls stay constrained.
    return OrFormat(elements=[AnyTextFormat(excludes=[think_end]), closed])
