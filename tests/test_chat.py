"""`apply_chat_template`: the model's own template, ids without doubled special tokens, clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncllm.chat import apply_chat_template
from asyncllm.errors import InvalidRequestError, UnsupportedModelError

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo, what is 2 + 2? 日本"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints: dict[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoints["llama"], local_files_only=True)


def test_text_follows_the_template(tokenizer: Any) -> None:
    text = apply_chat_template(tokenizer, MESSAGES)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHéllo, what is 2 + 2? 日本<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not apply_chat_template(tokenizer, MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_ids_encode_the_text_without_adding_special_tokens(tokenizer: Any) -> None:
    ids = apply_chat_template(tokenizer, MESSAGES, tokenize=True)
    assert ids == tokenizer.encode(apply_chat_template(tokenizer, MESSAGES), add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == apply_chat_template(tokenizer, MESSAGES)


def test_no_tokenizer_or_no_template_is_a_clear_error(tokenizer: Any) -> None:
    with pytest.raises(UnsupportedModelError, match="no tokenizer"):
        apply_chat_template(None, MESSAGES)

    class NoTemplate:
        chat_template = None

    with pytest.raises(UnsupportedModelError, match="no chat template"):
        apply_chat_template(NoTemplate(), MESSAGES)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\['role'\]"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a str"),
    ],
)
def test_bad_messages_name_the_field(tokenizer: Any, messages: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        apply_chat_template(tokenizer, messages)
