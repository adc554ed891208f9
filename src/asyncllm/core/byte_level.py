"""Byte-level BPE decoding in Python: each token id's bytes, looked up once, for tokenizers whose decoder is
a bare `ByteLevel` (GPT-2's scheme: Qwen2/3, Llama 3, SmolLM2 and most recent models).

Such a decoder is concatenative: the text of ids is the UTF-8 decoding, errors replaced, of their pieces'
bytes joined. So a stream of tokens decodes with a table lookup and Python's incremental UTF-8 decoder, which
replaces invalid bytes exactly as `tokenizers` does (both substitute one U+FFFD per maximal invalid subpart;
tests/core/test_byte_level.py compares them). That is cheaper per token than `DecodeStream.step` (bench/RESULTS.md,
host_step), and the step thread decodes every sequence's token every step. Tokenizers with any other decoder
(SentencePiece's metaspace, byte fallback) keep `DecodeStream`.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders


def _byte_chars() -> tuple[str, ...]:
    """GPT-2's map from each byte to the printable character standing for it: printable ASCII and Latin-1
    characters stand for themselves, the other 68 bytes for code points 256 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + n)) for n, b in enumerate(shifted))
    return tuple(chars[b] for b in range(256))


BYTE_CHARS = _byte_chars()  # BYTE_CHARS[b]: the character a byte-level vocabulary spells byte b with
_BYTE_OF_CHAR = {c: b for b, c in enumerate(BYTE_CHARS)}


class ByteLevelPieces:
    """`pieces[token_id]`: the bytes that token contributes to a decode (b"" for a special token when
    special tokens are skipped, and for an id the tokenizer does not know, as `Tokenizer.decode` skips them).
    Built lazily per id, so start-up pays nothing and memory grows with the ids actually sampled."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def of(cls, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> ByteLevelPieces | None:
        """The table for `tokenizer`, or None when its decoder is not a bare ByteLevel one."""
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            return None
        return cls(tokenizer, skip_special_tokens)

    def __getitem__(self, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> bytes:
        tokenizer = self._tokenizer
        token = tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        # Whether a decode skips the token is Rust's to say: it matches the token's string, normalized for
        # some added tokens, against the special contents it has seen (the ids' flags can disagree).
        skipped = tokenizer.decode([token_id]) == "" != tokenizer.decode([token_id], skip_special_tokens=False)
        if self.skip_special_tokens and skipped:
            return b""
        try:
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        except KeyError:  # as the ByteLevel decoder does: a token with any other character (an added token's
            return token.encode()  # literal content) contributes its own UTF-8, whole
