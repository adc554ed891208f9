"""Byte-level decoding in Python (`core/byte_level.py`) against the Rust tokenizer it stands in for: the same
text for any ids (special, added, unknown, cut characters, invalid bytes), streamed or whole, and the
`DecodeStream` path kept for tokenizers with any other decoder."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from asyncllm.core.byte_level import BYTE_CHARS, ByteLevelPieces
from asyncllm.core.detokenizer import IncrementalDetokenizer, backend_tokenizer
from tests.fixtures.tiny_models import build_tokenizer

_ADDED = ["中文<think>", "<tool>", "Ġé"]  # non-special added tokens: characters outside GPT-2's byte map too


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Built once for the module (hypothesis tests take no function-scoped fixtures); only read by the tests."""
    tok = backend_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))
    tok.add_tokens([AddedToken(t, special=False) for t in _ADDED])
    return tok


def _streamed(tok: Tokenizer, ids: list[int], pieces: ByteLevelPieces | None) -> str:
    detok = IncrementalDetokenizer(tok, [1, 2, 3], pieces=pieces)
    chunks = [detok.push(t) for t in ids]
    return "".join(chunks) + detok.flush()


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=8))
def test_the_byte_map_is_the_pre_tokenizers(text: str) -> None:
    """The byte-level pre-tokenizer spells text's UTF-8 bytes with BYTE_CHARS (every byte valid UTF-8 can
    hold; the others are checked through the decoder below), and the map covers its alphabet exactly."""
    assert set(BYTE_CHARS) == set(pre_tokenizers.ByteLevel.alphabet())
    spelled = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    assert "".join(piece for piece, _ in spelled) == "".join(BYTE_CHARS[b] for b in text.encode())


def test_only_a_bare_byte_level_decoder_gets_the_table(tok: Tokenizer) -> None:
    assert ByteLevelPieces.of(tok) is not None
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    assert ByteLevelPieces.of(metaspace) is None
    metaspace.decoder = decoders.Sequence([decoders.ByteLevel()])
    assert ByteLevelPieces.of(metaspace) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=24))
def test_python_replaces_invalid_utf8_as_the_byte_level_decoder_does(tok: Tokenizer, data: bytes) -> None:
    """Every byte has a piece of one character (the byte map); the decoder's lossy UTF-8 is Python's."""
    vocab = tok.get_vocab()
    ids = [vocab[BYTE_CHARS[b]] for b in data]
    assert tok.decode(ids) == data.decode("utf-8", "replace") == _streamed(tok, ids, ByteLevelPieces.of(tok))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=420), max_size=40), st.booleans())
def test_streamed_text_equals_a_whole_decode(tok: Tokenizer, ids: list[int], skip_special: bool) -> None:
    """Any ids: merged pieces, specials (skipped or not), added tokens, ids past the vocabulary, characters
    cut between tokens. The table's stream, and DecodeStream's, both end as `Tokenizer.decode` does."""
    assert tok.get_vocab_size(with_added_tokens=True) < 420  # some ids are unknown to the tokenizer
    pieces = ByteLevelPieces(tok, skip_special_tokens=skip_special)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special, pieces=pieces)
    text = "".join(detok.push(t) for t in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=skip_special)
    if skip_special:
        assert _streamed(tok, ids, None) == text


def test_added_and_special_tokens(tok: Tokenizer) -> None:
    pieces = ByteLevelPieces(tok)
    for content in _ADDED:
        token_id = tok.token_to_id(content)
        if all(c in BYTE_CHARS for c in content):  # spelled in the byte map: the bytes it spells
            assert pieces[token_id] == bytes(BYTE_CHARS.index(c) for c in content)
        else:  # any other character: the literal content, whole
            assert pieces[token_id] == content.encode()
        assert pieces[token_id].decode("utf-8", "replace") == tok.decode([token_id])
    assert pieces[tok.token_to_id("<|endoftext|>")] == b""
    assert ByteLevelPieces(tok, skip_special_tokens=False)[tok.token_to_id("<|endoftext|>")] == b"<|endoftext|>"
    assert pieces[10_000] == b""


def test_a_cut_character_is_held_then_completed_or_replaced(tok: Tokenizer) -> None:
    ids = [tok.get_vocab()[BYTE_CHARS[b]] for b in "日".encode()]
    detok = IncrementalDetokenizer(tok, [], pieces=ByteLevelPieces(tok))
    assert [detok.push(t) for t in ids] == ["", "", "日"]
    assert detok.flush() == ""
    detok = IncrementalDetokenizer(tok, [], pieces=ByteLevelPieces(tok))
    assert [detok.push(t) for t in ids[:2]] == ["", ""]
    assert detok.flush() == "\ufffd" == tok.decode(ids[:2])  # as a whole decode renders the cut


def test_skipping_follows_the_decoder_for_normalized_and_aliased_added_tokens(tmp_path: Path) -> None:
    """`Tokenizer.decode` skips by the token's string (normalized, for added tokens that ask for it) against
    the special contents it has seen, not by the ids' flags: the table asks it, so they never disagree."""
    tok = backend_tokenizer(build_tokenizer(tmp_path))  # its own: this test changes it
    tok.normalizer = normalizers.Lowercase()
    tok.add_special_tokens([AddedToken("<EOT>", normalized=True, special=True), AddedToken("<eos2>", special=True)])
    tok.add_tokens([AddedToken("<EOS2>", special=False, normalized=True)])  # normalizes to a special content
    tok.add_special_tokens(["<x>"])
    tok.add_tokens([AddedToken("<x>", special=False)])  # once special, always skipped
    pieces = ByteLevelPieces(tok)
    for content in ("<EOT>", "<eos2>", "<EOS2>", "<x>"):
        token_id = tok.token_to_id(content)
        text = tok.decode([token_id])
        assert pieces[token_id].decode("utf-8", "replace") == text, content
        ids = [token_id, tok.token_to_id("<x>"), token_id]
        assert _streamed(tok, ids, pieces) == tok.decode(ids)
