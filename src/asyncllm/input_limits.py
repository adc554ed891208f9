"""Bounds on what a client sends, checked before any tokenizer, template or compiler sees it.

Owns the bounds (nesting depth, size, counts) and the checks that apply them: each failure is one
`InvalidRequestError` naming the field and the bound. Nested values are walked with an explicit stack, never
by recursion (a 100,000-deep list must be refused, not crash the walk), and a walk stops at the first bound
passed, so its cost is bounded by the bound, not by what was sent. Plain Python; knows no request type.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.validation import short_repr

# Nesting of one JSON value a client hands over (a schema, a tool's parameters, a message): real schemas
# stay under 20 levels, and compile time grows with depth (a 200-deep schema took 1.5-3 s, issue 39).
MAX_JSON_DEPTH = 64
MAX_TOOLS = 128  # OpenAI's bound on tools per request
_SCALARS = frozenset({int, float, bool, type(None)})
MAX_LOGIT_BIAS = 300  # OpenAI's bound on biased tokens per request
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this: OpenAI's range, past which a token is certain or impossible anyway


@dataclass(frozen=True)
class PromptBounds:
    """How long one prompt may be: `max_tokens`, the longest sequence the engine holds, and `max_chars`, the
    most characters that many tokens can spell (`text_char_limit`; None: no vocabulary to bound them by)."""

    max_tokens: int
    max_chars: int | None


def text_char_limit(max_seq_len: int, max_token_chars: int | None) -> int | None:
    """The most characters a text may have and still fit `max_seq_len` tokens of a vocabulary whose longest
    token spells `max_token_chars` characters (None: no vocabulary to bound by). Longer texts are refused
    before the tokenizer spends seconds on them (prompts, a chat's messages)."""
    return None if max_token_chars is None else max_seq_len * max_token_chars


def check_unicode(field: str, text: str) -> None:
    """`InvalidRequestError` unless `text` is valid Unicode (no lone surrogate, which no tokenizer takes).
    Linear at C speed; ASCII text (most of it) is checked in one pass."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{field} is not valid Unicode text: {exc.reason} {text[exc.start]!r} at index {exc.start}"
        ) from None


def check_nested(
    field: str, value: Any, *, max_depth: int = MAX_JSON_DEPTH, max_chars: int | None = None, over: str = ""
) -> int:
    """Walk a JSON-like `value` (dicts, lists, tuples, strings, scalars): `InvalidRequestError` naming the
    place at fault if it nests deeper than `max_depth`, holds a lone surrogate in a string or key, or
    exceeds `max_chars` (string characters plus one per item: about its length as JSON text, at least;
    `over` says why that bound). Returns that size. A value that contains itself is refused by depth.
    Other leaves count one each."""
    size = 1
    stack: list[tuple[Any, int, _Path]] = [(value, 0, None)]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            size += len(node)
            _check_size(field, size, max_chars, over)
            if not node.isascii():  # after the size: a huge string is refused unread
                check_unicode(_where(field, path), node)
            continue
        is_map = isinstance(node, Mapping)
        if not (is_map or isinstance(node, (list, tuple))):
            continue  # a number, a bool, None (or another leaf): counted with its container
        if depth >= max_depth:
            raise InvalidRequestError(f"{_where(field, path)} nests deeper than {max_depth} levels")
        size += len(node)  # one per item, counted before any is read: a 10-million-item list stops here
        _check_size(field, size, max_chars, over)
        if not is_map:
            kinds = set(map(type, node))  # a flat list (an enum's 20,000 strings) is read at C speed
            if kinds <= _SCALARS:
                continue
            if kinds == {str}:
                size += sum(map(len, node))
                _check_size(field, size, max_chars, over)
                if not "".join(node).isascii():
                    for i, item in enumerate(node):
                        check_unicode(_where(field, (path, i)), item)
                continue
            stack.extend((item, depth + 1, (path, i)) for i, item in enumerate(node))
            continue
        for key, item in node.items():
            if isinstance(key, str):
                size += len(key)
                if not key.isascii():
                    check_unicode(f"a key of {_where(field, path)}", key)
            stack.append((item, depth + 1, (path, key)))
        _check_size(field, size, max_chars, over)
    return size


def _check_size(field: str, size: int, max_chars: int | None, over: str) -> None:
    if max_chars is not None and size > max_chars:
        why = f" ({over})" if over else ""
        raise InvalidRequestError(f"{field} is too large: more than {max_chars:,} characters{why}")


def check_json_text(field: str, text: str, *, max_chars: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`text` parsed as JSON, bounded first by its length, then by its nesting (`json.loads` itself recurses:
    past ~1,000 levels it raises RecursionError, refused here as too deep). ValueError (not JSON) is the
    caller's to word."""
    if len(text) > max_chars:
        raise InvalidRequestError(f"{field} is too large: {len(text):,} characters, more than {max_chars:,}")
    check_unicode(field, text)
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(f"{field} nests deeper than {max_depth} levels") from None
    check_nested(field, value, max_depth=max_depth)
    return value


def check_tools_size(tools: Any, max_chars: int) -> None:
    """A chat request's `tools`, bounded before anything reads them: at most `MAX_TOOLS`, each nested at most
    `MAX_JSON_DEPTH` levels below its `function.parameters`, `max_chars` in all (their grammar must fit it)."""
    if not isinstance(tools, (list, tuple)):
        return  # not a list: check_tools names the type
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: {len(tools)} tools, more than the {MAX_TOOLS} a request may offer")
    # {"type", "function": {"parameters": schema}}: the schema starts 2 levels into a tool.
    check_nested("tools", tools, max_depth=MAX_JSON_DEPTH + 3, max_chars=max_chars)


def check_logit_bias(field: str, bias: Any, vocab_size: int | None = None) -> dict[int, float]:
    """OpenAI's `logit_bias` ({token id: bias}, ids as ints or decimal strings) checked and normalised: at
    most `MAX_LOGIT_BIAS` entries, each bias a finite number in [-100, 100], each id in [0, vocab_size).
    Errors read "{field}={value} is invalid: ...", as `SamplingParams`' own do."""

    def fail(allowed: str) -> InvalidRequestError:
        huge = isinstance(bias, Mapping) and len(bias) > MAX_LOGIT_BIAS  # not repr'd whole to be cut short
        shown = f"<{len(bias)} entries>" if huge else short_repr(bias)
        return InvalidRequestError(f"{field}={shown} is invalid: {allowed}")

    if not isinstance(bias, Mapping):
        raise fail("a map of token ids to biases in [-100, 100]")
    if len(bias) > MAX_LOGIT_BIAS:
        raise fail(f"at most {MAX_LOGIT_BIAS} entries")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_id(key)
        if token is None or (vocab_size is not None and token >= vocab_size):
            where = "" if vocab_size is None else f" in [0, {vocab_size})"
            raise fail(f"{short_repr(key, 40)} is not a token id{where}")
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not finite or abs(value) > LOGIT_BIAS_LIMIT:
            raise fail(f"the bias of token {token} must be a number in [-100, 100], got {short_repr(value, 40)}")
        out[token] = float(value)
    return out


def _token_id(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit():
        return int(key)
    return None


# A place inside a walked value: (the parent's place, key or index); None is the value itself. Linked
# rather than joined per node: the walk pays a tuple per item, and only a refusal renders one.
_Path = tuple[Any, str | int] | None
_PATH_SHOWN = 6


def _where(field: str, path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f"[{str(key)[:40]!r}]")
    parts.reverse()
    if len(parts) > _PATH_SHOWN:  # a refusal 64 levels down names the way in, not all of it
        parts[_PATH_SHOWN:] = [f"...({len(parts) - _PATH_SHOWN} more)"]
    return field + "".join(parts)
