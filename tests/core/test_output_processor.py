"""OutputProcessor: stop decisions (EOS, stop ids, stop strings, lengths) and streamed text with hold-back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from asyncllm.core.detokenizer import backend_tokenizer
from asyncllm.core.output_processor import OutputProcessor
from asyncllm.core.request import Request
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from tests.fixtures.fake_executor import make_runtime
from tests.fixtures.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Built once for the module (hypothesis tests cannot take function-scoped fixtures); only read."""
    return backend_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


def _eos(tok: Tokenizer) -> int:
    return tok.token_to_id("<|endoftext|>")


def _request(tok: Tokenizer, params: SamplingParams, prompt: str = "Hello") -> Request:
    runtime = make_runtime(vocab_size=tok.get_vocab_size(), eos_token_ids=frozenset({_eos(tok)}))
    return InputProcessor(runtime, lambda s: tok.encode(s).ids).make_request("r", prompt, params, 0.0)


def _drive(tok: Tokenizer, request: Request, out_ids: list[int]) -> tuple[list[str], str | None, int]:
    """Feed tokens as the engine would; returns (chunks, finish reason, tokens consumed)."""
    op = OutputProcessor(tok)
    op.add_request(request)
    chunks: list[str] = []
    for n, token in enumerate(out_ids, start=1):
        request.append_token(token)
        text, reason = op.process_token(request, token)
        chunks.append(text)
        if reason is not None:
            assert op.flush(request.request_id) == ""  # a finish hands out everything
            return chunks, reason, n
    chunks.append(op.flush(request.request_id))
    return chunks, None, len(out_ids)


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def test_eos_stops_and_its_text_is_not_emitted(tok: Tokenizer) -> None:
    body = _ids(tok, "The capital")
    chunks, reason, n = _drive(tok, _request(tok, SamplingParams()), [*body, _eos(tok), *body])
    assert reason == "stop" and n == len(body) + 1
    assert "".join(chunks) == "The capital"


def test_eos_before_min_tokens_does_not_stop(tok: Tokenizer) -> None:
    a, eos = _ids(tok, "a")[0], _eos(tok)
    request = _request(tok, SamplingParams(min_tokens=3))
    chunks, reason, n = _drive(tok, request, [a, eos, a, eos, a])
    assert reason == "stop" and n == 4  # the first EOS is the 2nd token, under min_tokens; the 4th stops
    assert "".join(chunks) == "aa"


def test_ignore_eos_runs_to_max_tokens(tok: Tokenizer) -> None:
    a, eos = _ids(tok, "a")[0], _eos(tok)
    request = _request(tok, SamplingParams(ignore_eos=True, max_tokens=4))
    chunks, reason, n = _drive(tok, request, [eos, a, eos, a, a])
    assert reason == "length" and n == 4 and "".join(chunks) == "aa"


def test_stop_token_ids(tok: Tokenizer) -> None:
    ids = _ids(tok, "Hello world! Streaming")
    stop_id = ids[3]
    request = _request(tok, SamplingParams(stop_token_ids=[stop_id]))
    chunks, reason, n = _drive(tok, request, ids)
    assert reason == "stop" and n == ids.index(stop_id) + 1
    assert "".join(chunks) == tok.decode(ids[: n - 1])
    # Under min_tokens a stop id is an ordinary token.
    request = _request(tok, SamplingParams(stop_token_ids=[ids[0]], min_tokens=2))
    _, reason, n = _drive(tok, request, [ids[0], ids[1], ids[0], ids[2]])
    assert reason == "stop" and n == 3


def test_max_tokens_gives_length_exactly(tok: Tokenizer) -> None:
    ids = _ids(tok, "Hello world! Streaming tokens one at a time")
    chunks, reason, n = _drive(tok, _request(tok, SamplingParams(max_tokens=5)), ids)
    assert reason == "length" and n == 5 and "".join(chunks) == tok.decode(ids[:5])


def test_max_tokens_none_is_capped_by_max_model_len(tok: Tokenizer) -> None:
    request = _request(tok, SamplingParams(), prompt="Hello world")
    assert request.max_tokens == 256 - request.num_prompt_tokens


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tok: Tokenizer, include: bool) -> None:
    ids = _ids(tok, "Hello world! Streaming tokens")
    pieces = [tok.decode([t]) for t in ids]
    i = next(i for i in range(1, len(ids) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-1] + pieces[i + 1][0]
    before = "".join(pieces[:i]) + pieces[i][:-1]
    assert stop not in before
    request = _request(tok, SamplingParams(stop=[stop, "nowhere"], include_stop_str_in_output=include))
    chunks, reason, n = _drive(tok, request, ids)
    assert reason == "stop" and n == i + 2
    assert "".join(chunks) == before + (stop if include else "")


def test_held_text_is_flushed_on_length(tok: Tokenizer) -> None:
    ids = _ids(tok, "abcabc")
    request = _request(tok, SamplingParams(stop=["cab!"], max_tokens=len(ids)))
    chunks, reason, _ = _drive(tok, request, ids)
    assert reason == "length"
    assert all(len("".join(chunks[: k + 1])) <= max(0, len(tok.decode(ids[: k + 1])) - 3) for k in range(len(ids) - 1))
    assert "".join(chunks) == "abcabc"


def test_held_text_is_flushed_on_eos(tok: Tokenizer) -> None:
    ids = _ids(tok, "abca")
    chunks, reason, _ = _drive(tok, _request(tok, SamplingParams(stop=["ab!"])), [*ids, _eos(tok)])
    assert reason == "stop" and "".join(chunks) == "abca"


def test_abort_flush_releases_held_text(tok: Tokenizer) -> None:
    request = _request(tok, SamplingParams(stop=["xyz"]))
    op = OutputProcessor(tok)
    op.add_request(request)
    emitted = ""
    for token in _ids(tok, "abcd"):
        request.append_token(token)
        text, reason = op.process_token(request, token)
        assert reason is None
        emitted += text
    assert emitted == "ab"
    assert op.flush("r") == "cd" and op.flush("r") == ""


def test_stop_string_before_min_tokens_is_ignored(tok: Tokenizer) -> None:
    """Regression: a short stop generated before min_tokens, still held back for a longer stop, was found
    once min_tokens was reached, cutting text the request had been allowed to produce."""
    ids = [tok.token_to_id(c) for c in "abcde"]
    request = _request(tok, SamplingParams(stop=["ab", "wxyz"], min_tokens=3, max_tokens=5))
    chunks, reason, n = _drive(tok, request, ids)
    assert (reason, n, "".join(chunks)) == ("length", 5, "abcde")


_TEXT = "Zürich 日本語 😀🎉 café, naïve 中文字符 한국어"


def test_multibyte_characters_across_tokens(tok: Tokenizer) -> None:
    ids = _ids(tok, _TEXT)
    pieces = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces), "the test needs characters split across tokens"
    chunks, reason, _ = _drive(tok, _request(tok, SamplingParams(max_tokens=len(ids))), ids)
    assert reason == "length"
    assert "".join(chunks) == tok.decode(ids) == _TEXT
    assert not any("\ufffd" in c for c in chunks)


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    ids = _ids(tok, _TEXT)
    chunks, reason, _ = _drive(tok, _request(tok, SamplingParams(stop="語 😀")), ids)
    assert reason == "stop" and "".join(chunks) == "Zürich 日本"


# Pieces over a small alphabet so random stop strings actually occur; single- and multi-character tokens.
_PIECES = ["a", "b", "c", "d", "e", "dd", "de", "be", " a", " b", " c", " ", "  "]


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=25),
    stops=st.lists(st.text(alphabet="abcde ", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_streaming_never_leaks_a_partial_stop(
    tok: Tokenizer, pieces: list[str], stops: list[str], include: bool
) -> None:
    ids = [_ids(tok, p) for p in pieces]
    assert all(len(i) == 1 for i in ids)
    request = _request(tok, SamplingParams(stop=stops, include_stop_str_in_output=include), prompt="ab")
    chunks, reason, n = _drive(tok, request, [i[0] for i in ids])
    # Reference: the first token after which the text holds a stop; cut at the earliest one there.
    expected, expected_n = "".join(pieces), None
    for k in range(len(pieces)):
        text = "".join(pieces[: k + 1])
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            index, stop = min(found)
            expected, expected_n = text[: index + len(stop) if include else index], k + 1
            break
    assert "".join(chunks) == expected
    assert reason == ("stop" if expected_n else None) and (expected_n is None or n == expected_n)
    for k in range(len(chunks)):
        assert expected.startswith("".join(chunks[: k + 1])), "streamed text was later taken back"


def test_length_inside_a_character_ends_as_a_full_decode_would(tok: Tokenizer) -> None:
    ids = _ids(tok, _TEXT)
    cut = next(k for k in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:k]))  # ends mid-character
    chunks, reason, n = _drive(tok, _request(tok, SamplingParams(max_tokens=cut)), ids)
    assert reason == "length" and n == cut
    assert "".join(chunks) == tok.decode(ids[:cut])
