"""Every architecture asyncllm serves, one `Architecture` entry each, read by both loaders.

An entry names the Hugging Face architecture (`config.json`'s `architectures[0]`), the model class (whose
`FamilySpec` holds its checkpoint and GGUF tensor names) and, when llama.cpp writes the architecture, its GGUF
form: the `general.architecture` names, the transformers config class its metadata becomes, and llama.cpp's
quirks. Adding a family is one model file plus one entry here. Knows nothing about how models are built or
loaded.

Encoders (BERT) are entries too, answering the two questions an engine asks before it builds anything:
`Architecture.is_encoder` (a bidirectional `EncoderModel`: embeddings and scores only, never generation) and
`Architecture.classifies` (it has a classification head: a cross-encoder's scores); for a name,
`resolve_architecture(name).is_encoder`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.errors import UnsupportedModelError
from asyncllm.models.base import CausalLM, EncoderModel
from asyncllm.models.bert import BertForSequenceClassification, BertModel
from asyncllm.models.family import GGUFNames
from asyncllm.models.gemma3 import Gemma3ForCausalLM
from asyncllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from asyncllm.models.qwen3 import Qwen3ForCausalLM
from asyncllm.models.qwen3_moe import Qwen3MoeForCausalLM


@dataclass(frozen=True)
class GGUFForm:
    """How a GGUF file of this architecture is read."""

    names: tuple[str, ...]  # `general.architecture` values, e.g. ("llama",)
    permuted_qk: bool  # llama.cpp reorders Q/K rows of llama-family weights for its rotary layout
    # The config's `attention_bias` is not in the metadata: read it from whether layer 0 has a q bias.
    attention_bias_from_tensors: bool = False
    # llama.cpp's graph renormalises the top-k routing weights (the metadata does not say, unless it carries
    # `{arch}.expert_weights_norm`): the config's `norm_topk_prob`.
    renormalizes_experts: bool = False


@dataclass(frozen=True)
class Architecture:
    name: str  # hf_config.architectures[0]
    model_class: type[CausalLM] | type[EncoderModel]
    gguf: GGUFForm | None = None  # None: no GGUF form

    def __post_init__(self) -> None:
        if self.gguf is not None and self.model_class.family.weights.gguf is None:
            raise ValueError(f"{self.name} has a GGUF form but its family declares no GGUF tensor names")

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (`EncoderModel`: no KV cache, no generation), not a `CausalLM`."""
        return issubclass(self.model_class, EncoderModel)

    @property
    def classifies(self) -> bool:
        """An encoder with a classification head (`EncoderModel.classify`: a *ForSequenceClassification)."""
        return issubclass(self.model_class, EncoderModel) and self.model_class.classifies

    @property
    def gguf_names(self) -> GGUFNames:
        names = self.model_class.family.weights.gguf
        assert names is not None, self.name
        return names


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Qwen3ForCausalLM", Qwen3ForCausalLM, GGUFForm(("qwen3",), permuted_qk=False)),
    Architecture(
        "Qwen3MoeForCausalLM",
        Qwen3MoeForCausalLM,
        GGUFForm(("qwen3moe",), permuted_qk=False, renormalizes_experts=True),
    ),
    Architecture("Qwen2ForCausalLM", Qwen2ForCausalLM, GGUFForm(("qwen2",), permuted_qk=False)),
    Architecture(
        "LlamaForCausalLM",
        LlamaForCausalLM,
        GGUFForm(("llama",), permuted_qk=True, attention_bias_from_tensors=True),
    ),
    Architecture("MistralForCausalLM", MistralForCausalLM),  # llama.cpp writes Mistral as "llama"
    Architecture("Gemma3ForCausalLM", Gemma3ForCausalLM),  # no GGUF form (docs/models.md says why)
    Architecture("BertModel", BertModel),  # encoders: embeddings (and scores) only
    Architecture("BertForSequenceClassification", BertForSequenceClassification),
)
_BY_NAME = {a.name: a for a in ARCHITECTURES}
_BY_GGUF = {gguf: a for a in ARCHITECTURES if a.gguf is not None for gguf in a.gguf.names}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BY_NAME)
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_BY_GGUF))


def resolve_architecture(name: str | None) -> Architecture:
    """The entry for a Hugging Face architecture name; UnsupportedModelError for any other."""
    if name is None or name not in _BY_NAME:
        raise UnsupportedModelError(
            f"architecture {name!r} is not supported; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _BY_NAME[name]


def resolve_model_class(hf_config: Any) -> type[CausalLM] | type[EncoderModel]:
    """The model class for `hf_config.architectures[0]`; UnsupportedModelError for anything else."""
    architectures = getattr(hf_config, "architectures", None) or []
    return resolve_architecture(architectures[0] if architectures else None).model_class


def resolve_gguf_architecture(name: Any) -> Architecture:
    """The entry for a GGUF file's `general.architecture`; UnsupportedModelError for any other."""
    if not isinstance(name, str) or name not in _BY_GGUF:
        raise UnsupportedModelError(
            f"GGUF architecture {name!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return _BY_GGUF[name]
