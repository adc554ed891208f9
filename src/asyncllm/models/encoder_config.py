"""The facts a bidirectional encoder (BERT) adds to `ModelArchConfig`, read from a transformers config.

`read_encoder` answers None for every decoder config, so decoder families read exactly what they always
did. An encoder's shared fields keep their meaning (hidden_size, heads, layers, vocab_size,
max_position_embeddings), with its LayerNorm's `layer_norm_eps` as the norms' epsilon and its `hidden_act`
checked against the GELU forms it computes. Plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.errors import UnsupportedModelError

# transformers' `model_type` of the encoder configs asyncllm reads.
ENCODER_MODEL_TYPES = frozenset({"bert"})
# hidden_act -> torch's GELU `approximate`: "gelu" is the exact erf form; the two tanh forms differ only in
# rounding (transformers' NewGELUActivation spells out the formula torch's tanh GELU computes).
ENCODER_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class EncoderArch:
    """A bidirectional encoder's own fields: absolute positions, token types, a classifier's size."""

    type_vocab_size: int  # segment (token type) embeddings: 2 in BERT (sentence A / B)
    num_labels: int  # the classifier's outputs (len(id2label)); read by *ForSequenceClassification only
    layer_norm_eps: float

    def __post_init__(self) -> None:
        for name in ("type_vocab_size", "num_labels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(f"encoder config {name}={value!r} is invalid: expected an int >= 1")
        if not self.layer_norm_eps > 0:
            raise UnsupportedModelError(
                f"encoder config layer_norm_eps={self.layer_norm_eps!r} is invalid: expected > 0"
            )


def is_encoder_config(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) in ENCODER_MODEL_TYPES


def read_encoder(hf_config: Any) -> EncoderArch | None:
    """The encoder fields of a BERT config (None for any other), refusing what the maths here does not
    compute: relative position embeddings, decoder use, cross-attention."""
    if not is_encoder_config(hf_config):
        return None
    kind = getattr(hf_config, "position_embedding_type", None) or "absolute"
    if kind != "absolute":
        raise UnsupportedModelError(
            f"position_embedding_type={kind!r} is not supported: asyncllm's BERT computes absolute position "
            "embeddings only"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if getattr(hf_config, flag, False):
            raise UnsupportedModelError(f"{flag}=True is not supported: asyncllm's BERT is a bidirectional encoder")
    id2label = getattr(hf_config, "id2label", None)
    num_labels = len(id2label) if id2label else getattr(hf_config, "num_labels", 1)
    return EncoderArch(
        type_vocab_size=getattr(hf_config, "type_vocab_size", 2),
        num_labels=num_labels,
        layer_norm_eps=float(getattr(hf_config, "layer_norm_eps", 1e-12)),
    )
