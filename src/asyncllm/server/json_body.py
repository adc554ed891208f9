"""A request body, bounded before any field of it is read: at most `body_byte_limit` bytes (read no further:
a 413, the connection closed), JSON nested at most `MAX_BODY_DEPTH` levels, and no lone surrogate in any
string (JSON's "\\ud800" escape decodes to one; no tokenizer takes it, and a JSON response echoing it cannot
be encoded). A refusal names the top-level field at fault.

The JSON checks cost nothing for ordinary bodies: a body with fewer brackets than the bound cannot nest past
it, and one without a surrogate escape holds no surrogate. Only the others are scanned, at C speed (numpy
over the bytes, off the event loop for a large body; json's own encoder for surrogates). Knows no request
model.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import Request

from asyncllm.input_limits import MAX_JSON_DEPTH, PromptBounds
from asyncllm.server.errors import OpenAIError
from asyncllm.structured import MAX_CONSTRAINT_CHARS

# A schema sits 4 levels into a body (body.response_format.json_schema.schema, body.tools[i].function.parameters)
# and may nest MAX_JSON_DEPTH levels itself; json.loads recurses, and fails past ~1,000 levels.
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 16
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # may precede a lone surrogate (or half of a good pair)
_SHOWN_ITEMS = 1_000  # a list field is searched item by item for its bad item up to this length
_SCAN_IN_THREAD = 2**18  # bytes from which the depth scan runs off the loop


def body_byte_limit(bounds: PromptBounds | None) -> int | None:
    """The most bytes a request body may have: the longest prompt (or chat) the engine holds and a constraint
    of the longest kind, each character of either as a 6-byte JSON escape, and 1 MiB for every other field
    (None: no engine yet). A completions batch of prompts must fit in it too: send a larger one in parts."""
    if bounds is None or bounds.max_chars is None:
        return None
    return 6 * (bounds.max_chars + MAX_CONSTRAINT_CHARS) + 2**20


async def read_body_bytes(request: Request, limit: int | None) -> bytes:
    """The body, read no further than `limit` bytes: past it (or a Content-Length past it) an OpenAIError 413
    whose response closes the connection, so the rest is never read."""
    if limit is None:
        return await request.body()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        f"the request body has {size:,} bytes (at least), more than the {limit:,} a request to this server may "
        "have (its longest prompt and constraint as JSON): shorten it, or send a batch of prompts in parts",
        status=413,
        code="request_too_large",
        headers={"connection": "close"},
    )


async def parse_json_body(raw: bytes) -> Any:
    """`raw` decoded: ValueError (JSONDecodeError, UnicodeDecodeError) when it is not JSON text, OpenAIError
    (400, naming the field) when it nests too deep or holds a lone surrogate."""
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH:
        if len(raw) < _SCAN_IN_THREAD:  # a millisecond or less: not worth a thread's hand-off
            offset = first_too_deep(raw, MAX_BODY_DEPTH)
        else:
            offset = await asyncio.to_thread(first_too_deep, raw, MAX_BODY_DEPTH)
        if offset is not None:
            field = top_level_field(raw, offset)
            at = f" (in {field})" if field else ""
            raise OpenAIError(f"the request body nests deeper than {MAX_BODY_DEPTH} levels{at}", param=field)
    try:
        data = json.loads(raw)
    except RecursionError:  # the scan above makes this unreachable for JSON; kept as the last word
        raise OpenAIError(f"the request body nests deeper than {MAX_BODY_DEPTH} levels") from None
    if _SURROGATE_ESCAPE.search(raw) is not None:
        _check_surrogates(data)
    return data


def first_too_deep(raw: bytes, bound: int) -> int | None:
    """The offset of the first byte of JSON text `raw` at which objects and arrays nest past `bound` (brackets
    inside strings not counted), or None. Vectorised: numpy lets go of the GIL over the arrays."""
    import numpy as np

    data = np.frombuffer(raw, np.uint8)
    steps = _steps(np)[data]  # +1 opening, -1 closing, 0 otherwise
    steps[_inside_strings(np, data)] = 0
    over = np.cumsum(steps, dtype=np.int32) > bound
    first = int(np.argmax(over))
    return first if over[first] else None


def _steps(np: Any) -> Any:
    table = np.zeros(256, np.int8)
    table[list(b"[{")] = 1
    table[list(b"]}")] = -1
    return table


def _inside_strings(np: Any, data: Any) -> Any:
    """A mask of the bytes within strings (from an opening quote to the byte before its closing one); a quote
    after an odd run of backslashes is escaped, inside its string."""
    quotes = np.flatnonzero(data == ord('"'))
    slash = data == ord("\\")
    if quotes.size and slash.any():
        # For each byte, the index of the last byte at or before it that is not a backslash.
        index = np.arange(data.size, dtype=np.int64)
        last_other = np.maximum.accumulate(np.where(slash, -1, index))
        before = quotes - 1
        run = np.where(before >= 0, before - last_other[np.maximum(before, 0)], 0)
        quotes = quotes[run % 2 == 0]
    toggles = np.zeros(data.size, np.int8)
    toggles[quotes] = 1
    return (np.cumsum(toggles, dtype=np.int32) & 1).astype(bool)


def top_level_field(raw: bytes, offset: int) -> str | None:
    """The name of the member of a JSON object body whose value holds byte `offset` (None: not found). Reads
    back from `offset` to the nearest `"name":` at the body's top level, decoding no more than that name."""
    import numpy as np

    head = np.frombuffer(raw[:offset], np.uint8)
    steps = _steps(np)[head]
    inside = _inside_strings(np, head)
    steps[inside] = 0
    level = np.cumsum(steps, dtype=np.int32)
    colons = np.flatnonzero((head == ord(":")) & ~inside & (level == 1))
    if not colons.size:
        return None
    key_end = raw.rfind(b'"', 0, int(colons[-1]))  # the closing quote of the name (names have no escapes here)
    key_start = raw.rfind(b'"', 0, key_end)
    try:
        name = json.loads(raw[key_start : key_end + 1])
    except ValueError:
        return None
    return name if isinstance(name, str) and name.isidentifier() else None


def _check_surrogates(data: Any) -> None:
    """OpenAIError naming the first top-level field (and list item) whose strings hold a lone surrogate. json's
    C encoder writes the value; encoding that as UTF-8 fails exactly on a lone surrogate."""
    members = data.items() if isinstance(data, dict) else [(None, data)]
    for name, value in members:
        if _has_surrogate(name):  # a name is echoed too ("Unrecognized request argument supplied: ...")
            raise OpenAIError("the request body holds invalid Unicode text: a lone surrogate in a field's name")
        if not _has_surrogate(value):
            continue
        param = name if isinstance(name, str) and name.isidentifier() else None
        if param is not None and isinstance(value, list) and len(value) <= _SHOWN_ITEMS:
            index = next((i for i, item in enumerate(value) if _has_surrogate(item)), None)
            param = f"{param}[{index}]" if index is not None else param
        where = f"{param} holds" if param else "the request body holds"
        raise OpenAIError(f"{where} invalid Unicode text: a lone surrogate (half of a UTF-16 pair)", param=param)


def _has_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
