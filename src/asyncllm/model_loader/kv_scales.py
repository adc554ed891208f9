"""KV-cache scales in a checkpoint: the per-layer k_scale and v_scale an FP8 KV cache divides keys and values by,
taken out of the weight stream in each naming published checkpoints use and set on the attention layers.

For an attention module `P` (`model.layers.N.self_attn`): `P.k_scale` and `P.v_scale` (compressed-tensors and
vLLM's FP8 checkpoints), `P.kv_scale` (older: one scale for both), `P.k_proj.k_scale` and `P.v_proj.v_scale`
(NVIDIA ModelOpt), `P.k_proj.output_scale` and `P.v_proj.output_scale` (older compressed-tensors). `P.q_scale`
and `P.prob_scale` scale FP8 attention's queries and probabilities, which asyncllm does not quantize: dropped.
Each scale is one finite number > 0 (per-head scales are refused). Knows the model only through its `Attention`
layers, named `P.attn`; a cache in the model's dtype never reads what is set here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from asyncllm.attention.layer import Attention
from asyncllm.errors import UnsupportedModelError

logger = logging.getLogger("asyncllm")

Weights = Iterator[tuple[str, torch.Tensor]]

# (suffix of the checkpoint name, which scales it holds); the attention module is the name before the suffix.
_SUFFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".k_proj.k_scale", ("k",)),
    (".v_proj.v_scale", ("v",)),
    (".k_proj.output_scale", ("k",)),
    (".v_proj.output_scale", ("v",)),
    (".k_scale", ("k",)),
    (".v_scale", ("v",)),
    (".kv_scale", ("k", "v")),
    (".q_scale", ()),
    (".prob_scale", ()),
)


def kv_scale_name(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(attention module, the scales the tensor holds: "k", "v", both or none) for a KV-cache scale's checkpoint
    name; None for any other tensor."""
    for suffix, which in _SUFFIXES:
        if name.endswith(suffix) and ".self_attn" in name:
            return name[: -len(suffix)], which
    return None


class KVScales:
    """Collects a checkpoint's KV-cache scales as its tensors stream by (`take`), then sets them on the model's
    attention layers (`apply`)."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, float]] = {}  # attention module -> {"k": k_scale, "v": v_scale}

    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Weights:
        """`weights` without their KV-cache scales, which are kept here."""
        for name, tensor in weights:
            hit = kv_scale_name(name)
            if hit is None:
                yield name, tensor
                continue
            module, which = hit
            value = _scale(name, tensor) if which else None
            for kind in which:
                scales = self.found.setdefault(module, {})
                if kind in scales:
                    raise UnsupportedModelError(f"checkpoint gives {module}'s {kind}_scale twice (again in {name!r})")
                assert value is not None
                scales[kind] = value

    def apply(self, model: nn.Module) -> int:
        """Set every scale found on its attention layer; returns how many layers got theirs. A checkpoint that
        scales some layers leaves the others at 1.0, with a warning."""
        layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
        for module, scales in self.found.items():
            layer = layers.get(f"{module}.attn")
            if layer is None:
                raise UnsupportedModelError(
                    f"checkpoint has KV-cache scales for {module!r}, which is no attention layer of "
                    f"{type(model).__name__}: the checkpoint does not match its config.json architecture"
                )
            missing = {"k", "v"} - set(scales)
            if missing:
                raise UnsupportedModelError(
                    f"checkpoint has {module}'s {({'k', 'v'} - missing).pop()}_scale but not its {missing.pop()}_scale"
                )
            layer.set_kv_scales(scales["k"], scales["v"])
        if self.found and len(self.found) < len(layers):
            logger.warning(
                "the checkpoint carries KV-cache scales for %d of %d attention layers; the others use 1.0",
                len(self.found),
                len(layers),
            )
        return len(self.found)


def _scale(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1 or not tensor.is_floating_point():
        raise UnsupportedModelError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}: a KV-cache scale "
            "is one floating-point number per layer (per-head or per-channel KV scales are not supported)"
        )
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise UnsupportedModelError(f"checkpoint tensor {name!r} is {value}: a KV-cache scale must be finite and > 0")
    return value
