"""resolve_model_class: the four supported architectures, and a helpful error for any other."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncllm.errors import UnsupportedModelError
from asyncllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.registry import SUPPORTED_ARCHITECTURES, resolve_model_class


@pytest.mark.parametrize(
    "cls", [Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM], ids=lambda c: c.__name__
)
def test_supported_architectures_resolve(cls: type) -> None:
    assert cls.__name__ in SUPPORTED_ARCHITECTURES
    assert resolve_model_class(SimpleNamespace(architectures=[cls.__name__])) is cls


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], [], None])
def test_unsupported_architecture_lists_the_supported_ones(architectures: list[str] | None) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        resolve_model_class(SimpleNamespace(architectures=architectures))
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(info.value)
    assert isinstance(info.value, ValueError)
