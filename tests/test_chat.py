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


def test_tools_and_template_variables_reach_the_template(tokenizer: Any) -> None:
    template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ flavour }}"
    tools = [{"type": "function", "function": {"name": name}} for name in ("f", "g")]
    text = apply_chat_template(
        tokenizer, MESSAGES, chat_template=template, tools=tools, template_kwargs={"flavour": "x"}
    )
    assert text == "f;g;x"
    assert apply_chat_template(tokenizer, MESSAGES, chat_template="{{ tools is none }}") == "True"


def test_past_calls_reach_the_template_with_object_arguments(tokenizer: Any) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    template = (
        "{% for m in messages %}[{{ m.content }}]"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    assert apply_chat_template(tokenizer, messages, chat_template=template) == "[hi][]Paris[sunny]"
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the caller's message is left as it was
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]\['tool_calls'\] must be a list"):
        apply_chat_template(tokenizer, [messages[0], {**messages[1], "tool_calls": "f()"}], chat_template=template)


def test_named_templates_pick_tool_use_when_tools_are_offered() -> None:
    class Named:
        def __init__(self) -> None:
            self.chat_template = {"default": "plain", "tool_use": "with tools"}

        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
            return str(kwargs["chat_template"])

    tools = [{"type": "function", "function": {"name": "f"}}]
    assert apply_chat_template(Named(), MESSAGES) == "plain"  # type: ignore[arg-type]
    assert apply_chat_template(Named(), MESSAGES, tools=tools) == "with tools"  # type: ignore[arg-type]
