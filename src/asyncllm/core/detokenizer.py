"""Incremental detokenization: constant work per token, correct across multi-byte characters.

Byte-level tokenizers decode through their pieces' bytes (`byte_level.ByteLevelPieces`, a table lookup and
Python's incremental UTF-8 decoder); the others through `tokenizers.decoders.DecodeStream`, primed with the
prompt's tail so the first output token is decoded in context (leading spaces, byte-fallback pieces).
Emitted text only ever grows.
"""

from __future__ import annotations

import codecs
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from asyncllm.core.byte_level import ByteLevelPieces
from asyncllm.errors import UnsupportedModelError

_PROMPT_CONTEXT = 8  # prompt tokens primed into the stream; enough for any merge or byte sequence


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the tokenizer itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise UnsupportedModelError(
            f"{type(tokenizer).__name__} has no fast (Rust) tokenizer; asyncllm needs a tokenizer.json"
        )
    return backend


def max_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters one token of `tokenizer` stands for: its longest vocabulary entry.

    Entries are spelled at least as long as the text they decode to (byte-level entries spell one
    character per byte; metaspace and byte-fallback entries no fewer), so a text of more than
    `n * max_token_chars` characters surely has more than `n` tokens. One pass over the vocabulary: call once.
    """
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)


class IncrementalDetokenizer:
    """One request's output text, a token at a time. With `pieces` (a byte-level tokenizer's table, shared
    by every request) it decodes the pieces' bytes incrementally; otherwise through `DecodeStream`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        pieces: ByteLevelPieces | None = None,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        if pieces is not None and pieces.skip_special_tokens != skip_special_tokens:
            raise ValueError(f"pieces skip special tokens={pieces.skip_special_tokens}, not {skip_special_tokens}")
        self._pieces = pieces
        self._held = b""  # byte-level only: the bytes of a character cut between tokens
        self._stream: DecodeStream | None = None
        if pieces is None:  # byte-level text needs no context: the prompt's bytes never change the output's
            context = prompt_token_ids[-_PROMPT_CONTEXT:]
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # DecodeStream only: tokens pushed since it last produced text

    def push(self, token_id: int) -> str:
        """Decode one more token; returns the new text ("" while a multi-byte character is incomplete)."""
        if self._stream is None:  # codecs' incremental decoder, minus its Python frame
            assert self._pieces is not None
            data = self._held + self._pieces[token_id] if self._held else self._pieces[token_id]
            decoded, used = codecs.utf_8_decode(data, "replace", False)
            self._held = data[used:]
            return decoded
        text = self._stream.step(self._tokenizer, token_id)
        if text:
            self._pending.clear()
            return text
        self._pending.append(token_id)
        return ""

    def flush(self) -> str:
        """Text of tokens still held for an incomplete character, as a full decode renders them (U+FFFD),
        so a finished request's text equals `tokenizer.decode` of its ids."""
        if self._stream is None:  # the bytes of a cut character, even after text that came with them
            text, _ = codecs.utf_8_decode(self._held, "replace", True)
            self._held = b""
            return text
        if not self._pending:
            return ""
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special)
        self._pending.clear()
        return text
