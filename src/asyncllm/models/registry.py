"""Which model class serves which Hugging Face architecture name.

Owns the list of supported architectures and the error for any other; knows nothing about how models are
built or loaded.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from asyncllm.errors import UnsupportedModelError
from asyncllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def resolve_model_class(hf_config: Any) -> type[nn.Module]:
    """The model class for `hf_config.architectures[0]`; UnsupportedModelError for anything else."""
    architectures = getattr(hf_config, "architectures", None) or []
    name = architectures[0] if architectures else None
    if name not in _MODELS:
        raise UnsupportedModelError(
            f"architecture {name!r} is not supported; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _MODELS[name]
