"""Quantizing a built model from outside, as tensor parallelism shards it: every linear layer the scheme
quantizes (plain, packed or row-parallel) is swapped for its `QuantLinear` form, before weights are loaded.

Embeddings and the LM head are not linear layers here and stay in the model's dtype. A packed layer is
quantized only whole, in the one scheme the scheme gives its checkpoint modules (`QuantScheme.layer_scheme`:
a GGUF layer's may differ from its neighbours'). Knows no family's names: the packing comes in as
the family plan's mapping (checkpoint module -> (our module, shard)).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from asyncllm.errors import UnsupportedModelError
from asyncllm.layers.linear import Linear, Packed
from asyncllm.layers.parallel import RowParallelLinear
from asyncllm.quantization.linear import PackedQuantLinear, QuantLinear
from asyncllm.quantization.scheme import QuantScheme


def quantize_linear_layers(
    model: nn.Module, scheme: QuantScheme, packed: Mapping[str, tuple[str, str]]
) -> dict[str, QuantScheme]:
    """Swap the model's linear layers for quantized ones (parameters uninitialised, to be loaded); returns the
    checkpoint modules now quantized (e.g. model.layers.0.self_attn.q_proj), each with its layer's scheme."""
    checkpoint_module = {ours: ckpt for ckpt, ours in packed.items()}  # (our module, shard) -> checkpoint module
    quantized: dict[str, QuantScheme] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        parent_name, _, attr = name.rpartition(".")
        prefix = f"{parent_name}." if parent_name else ""
        if isinstance(module, Packed):
            names = [prefix + checkpoint_module[(attr, shard)] for shard in module.shard_sizes]
        else:
            names = [name]
        layer = scheme.layer_scheme(names)
        if layer is None:
            continue
        setattr(model.get_submodule(parent_name), attr, _quantized(module, layer))
        quantized.update(dict.fromkeys(names, layer))
    if not quantized:
        raise UnsupportedModelError(f"the {scheme.method} scheme quantizes none of the model's linear layers")
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the 16-bit weights the model was built with are gone: give their memory back
    return quantized


def _quantized(module: Linear, scheme: QuantScheme) -> QuantLinear:
    out_features, in_features = module.weight.shape
    device = module.weight.device
    if isinstance(module, Packed):
        return PackedQuantLinear(in_features, module.shard_sizes, scheme, bias=module.bias, device=device)
    group = module.group if isinstance(module, RowParallelLinear) else None
    return QuantLinear(in_features, out_features, scheme, bias=module.bias, device=device, group=group)
