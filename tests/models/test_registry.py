"""The registry: one entry per architecture, read by the Hugging Face and the GGUF loader alike; the
supported architectures, and a helpful error for any other."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncllm.errors import UnsupportedModelError
from asyncllm.models.gemma3 import Gemma3ForCausalLM
from asyncllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.registry import (
    ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_GGUF_ARCHITECTURES,
    resolve_gguf_architecture,
    resolve_model_class,
)


@pytest.mark.parametrize(
    "cls",
    [Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Gemma3ForCausalLM],
    ids=lambda c: c.__name__,
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


def test_one_entry_per_name_feeds_both_loaders() -> None:
    """Each HF and GGUF name belongs to one entry; a GGUF architecture resolves to the same model class as
    the Hugging Face name its config will carry."""
    assert len({a.name for a in ARCHITECTURES}) == len(ARCHITECTURES)
    gguf_names = [name for a in ARCHITECTURES if a.gguf is not None for name in a.gguf.names]
    assert len(set(gguf_names)) == len(gguf_names) and sorted(gguf_names) == list(SUPPORTED_GGUF_ARCHITECTURES)
    for name in gguf_names:
        entry = resolve_gguf_architecture(name)
        assert resolve_model_class(SimpleNamespace(architectures=[entry.name])) is entry.model_class
        assert entry.gguf_names.blocks  # derived from the family's spec
    assert resolve_gguf_architecture("llama").model_class is LlamaForCausalLM
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        resolve_gguf_architecture("gpt2")


def test_encoders_are_flagged() -> None:
    """An engine asks the entry whether an architecture is an encoder (embed / score only) and whether it
    classifies (a cross-encoder's scores); every decoder answers no to both."""
    from asyncllm.models.bert import BertForSequenceClassification, BertModel
    from asyncllm.models.registry import resolve_architecture

    flags = {a.name: (a.is_encoder, a.classifies) for a in ARCHITECTURES}
    assert flags.pop("BertModel") == (True, False)
    assert flags.pop("BertForSequenceClassification") == (True, True)
    assert set(flags.values()) == {(False, False)}
    assert resolve_architecture("BertModel").model_class is BertModel
    assert resolve_model_class(SimpleNamespace(architectures=["BertForSequenceClassification"])) is (
        BertForSequenceClassification
    )
