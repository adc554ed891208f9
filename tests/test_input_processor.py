"""InputProcessor: every bad request is refused up front with an error naming the problem."""

from __future__ import annotations

import random

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.input_processor import InputProcessor
from asyncllm.sampling_params import SamplingParams
from tests.fixtures.fake_executor import make_runtime

VOCAB = 100


def _processor(*, max_model_len: int = 64, num_kv_blocks: int = 32, block_size: int = 4) -> InputProcessor:
    runtime = make_runtime(
        vocab_size=VOCAB,
        max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        eos_token_ids=frozenset({2}),
    )
    return InputProcessor(runtime, lambda text: [ord(c) % VOCAB for c in text])


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ((), "prompt is empty"),
        ([5, VOCAB], f"token id {VOCAB} is outside the vocabulary"),
        ([5, -1], "token id -1 is outside the vocabulary"),
        ([5, 10**12], "outside the vocabulary"),
        ([5, 1.0], "must all be integers"),
        ([5, "7"], "must all be integers"),
        ([5, True], "must all be integers"),
        ([[5, 6]], "must all be integers"),
        (None, "prompt must be a str or a list of token ids, not NoneType"),
        ({"ids": [1]}, "not dict"),
        (b"bytes", "not bytes"),
    ],
)
def test_bad_prompts(prompt: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        _processor().make_request("r", prompt, None, 0.0)


def test_bad_params_type() -> None:
    with pytest.raises(InvalidRequestError, match="params must be a SamplingParams, not dict"):
        _processor().make_request("r", [1, 2], {"temperature": 0.0}, 0.0)  # type: ignore[arg-type]


def test_text_prompt_needs_a_tokenizer() -> None:
    ip = InputProcessor(make_runtime(vocab_size=VOCAB), None)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        ip.make_request("r", "hello", None, 0.0)
    assert ip.make_request("r", [3, 4], None, 0.0).prompt_token_ids == [3, 4]
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        ip.make_request("r", [3, 4], SamplingParams(stop="###"), 0.0)
    assert ip.make_request("r", [3, 4], SamplingParams(stop_token_ids=[7]), 0.0).params.stop_token_set == {7}


def test_prompt_plus_min_tokens_over_max_model_len() -> None:
    ip = _processor(max_model_len=64)
    with pytest.raises(InvalidRequestError, match=r"min_tokens \(5.*max_model_len \(64\)"):
        ip.make_request("r", _ids(60), SamplingParams(min_tokens=5), 0.0)
    with pytest.raises(InvalidRequestError, match=r"prompt \(64 tokens\).*max_model_len \(64\)"):
        ip.make_request("r", _ids(64), None, 0.0)  # no room for even one token
    request = ip.make_request("r", _ids(59), SamplingParams(min_tokens=5), 0.0)  # exactly fits
    assert request.max_tokens == 5


def test_prompt_larger_than_the_whole_kv_cache() -> None:
    ip = _processor(max_model_len=1000, num_kv_blocks=8, block_size=4)
    with pytest.raises(InvalidRequestError, match=r"33 tokens, more than the whole KV cache holds \(32 tokens"):
        ip.make_request("r", _ids(33), None, 0.0)
    # A prompt filling the cache leaves no room to generate: the KV cache is named as the binding limit.
    with pytest.raises(InvalidRequestError, match=r"KV cache capacity \(32 tokens; max_model_len is 1000\)"):
        ip.make_request("r", _ids(32), None, 0.0)
    assert ip.make_request("r", _ids(31), None, 0.0).max_tokens == 1


def test_max_tokens_resolution() -> None:
    ip = _processor(max_model_len=64)
    prompt = _ids(10, seed=1)
    assert ip.make_request("a", prompt, None, 0.0).max_tokens == 54
    assert ip.make_request("b", prompt, SamplingParams(max_tokens=7), 0.0).max_tokens == 7
    assert ip.make_request("c", prompt, SamplingParams(max_tokens=54), 0.0).max_tokens == 54


def test_max_tokens_past_the_room_is_refused_not_clamped() -> None:
    """Regression (issue 22): max_tokens larger than what the prompt leaves was silently cut to the room
    (OpenAI and vLLM answer 400); now it is refused, naming the field, the prompt length and the room."""
    ip = _processor(max_model_len=64)
    prompt = _ids(10, seed=1)
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.max_tokens=55 does not fit: the prompt has 10 "):
        ip.make_request("c", prompt, SamplingParams(max_tokens=55), 0.0)
    with pytest.raises(InvalidRequestError, match=r"max_model_len \(64\) leaves room for 54; lower max_tokens"):
        ip.make_request("c", prompt, SamplingParams(max_tokens=500), 0.0)


def test_valid_request_fields() -> None:
    ip = _processor()
    params = SamplingParams(temperature=0.0, max_tokens=3)
    request = ip.make_request("id-1", "hi!", params, 12.5)
    assert request.prompt_token_ids == [ord(c) % VOCAB for c in "hi!"]
    assert request.all_token_ids == request.prompt_token_ids and request.all_token_ids is not request.prompt_token_ids
    assert (request.request_id, request.params, request.arrival_time) == ("id-1", params, 12.5)
    assert request.eos_token_ids == frozenset({2})
    assert ip.make_request("x", [1], SamplingParams(ignore_eos=True), 0.0).eos_token_ids == frozenset()
    ids = (4, 5, 6)
    assert ip.make_request("y", ids, None, 0.0).prompt_token_ids == [4, 5, 6]
