"""The architecture is checked first: a checkpoint of any other family fails with `UnsupportedModelError`
naming its architecture and listing the supported ones, before its other fields are read (regression: a
GPT-2 config crashed with AttributeError in models/config.py; a Phi config was refused for its activation)."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from asyncllm import LLM
from asyncllm.errors import UnsupportedModelError
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import SUPPORTED_ARCHITECTURES

CONFIGS = {
    "GPT2LMHeadModel": lambda: transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8),
    "PhiForCausalLM": lambda: transformers.PhiConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2),
}


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_another_family_is_refused_for_its_architecture(architecture: str, tmp_path: Path) -> None:
    config = CONFIGS[architecture]()
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        LLM(str(tmp_path), device="cpu")
    message = str(info.value)
    assert f"architecture {architecture!r} is not supported" in message, message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES), message
    assert "hidden_act" not in message


def test_config_json_without_architectures_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UnsupportedModelError, match="names no `architectures`"):
        LLM(str(tmp_path), device="cpu")


def test_a_config_missing_a_field_is_unsupported_not_an_attribute_error() -> None:
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel config has no intermediate_size"):
        ModelArchConfig.from_hf(config, None)
