"""Pure pieces of the server, without HTTP: validation-error locations become OpenAI `param`s, SamplingParams
errors keep their field under its OpenAI name, logprobs stay valid JSON, token strings work without a
tokenizer."""

from __future__ import annotations

import json

import pytest

from asyncllm import AsyncLLMEngine
from asyncllm.errors import InvalidRequestError
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.errors import _param_from_loc, invalid_request
from asyncllm.server.logprobs import TokenStrings, chat_logprobs, completion_logprobs


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body", "temperature"), "temperature"),
        (("body", "messages", 0, "content"), "messages[0].content"),
        (("body", "stop", "list[str]", 1), "stop"),  # a union member's tag is not a field
        (("body", "stop", "str"), "stop"),
        (("body",), None),
        (("body", 13), None),  # where invalid JSON broke
    ],
)
def test_param_from_validation_location(loc: tuple[object, ...], param: str | None) -> None:
    assert _param_from_loc(loc) == param


def test_sampling_errors_name_the_openai_field() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=0)
    error = invalid_request(info.value, param="messages", renames={"max_tokens": "max_completion_tokens"})
    assert (error.status, error.param) == (400, "max_completion_tokens")
    plain = invalid_request(InvalidRequestError("prompt is empty"), param="prompt")
    assert plain.param == "prompt" and plain.body()["error"]["type"] == "invalid_request_error"


def test_logprobs_stay_valid_json_and_ordered() -> None:
    strings = TokenStrings(None)
    dists = [{7: float("-inf"), 5: float("nan"), 3: -0.1}]
    chat = chat_logprobs([7], dists, 3, strings)
    json.loads(json.dumps(chat, allow_nan=False))  # no -Infinity / NaN in the body
    (token,) = chat["content"]
    assert token["token"] == "<token 7>" and token["logprob"] == -9999.0
    assert token["top_logprobs"][0]["token"] == "<token 3>"  # NaN and -inf sort last
    completion = completion_logprobs([3, 7], [{3: -0.1}, {7: -1.0}], 1, strings, offset=4)
    assert completion["text_offset"] == [4, 4 + len("<token 3>")]


def test_byte_level_tokens_carry_their_own_bytes(engine: AsyncLLMEngine) -> None:
    """A token holding part of a character reads as U+FFFD, but its `bytes` are exact: they add up."""
    tokenizer = engine.tokenizer  # the tiny checkpoints' byte-level BPE
    strings = TokenStrings(tokenizer)
    text = "日本語のテキスト 😀🎉 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in strings(i) for i in ids)  # the corpus splits some characters across tokens
    assert bytes(b for i in ids for b in strings.bytes(i)).decode() == text
