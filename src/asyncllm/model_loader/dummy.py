"""Random weights of a model's real shape, for benchmarks (`load_format="dummy"`)."""

from __future__ import annotations

import torch
from torch import nn

from asyncllm.quantization.linear import QuantLinear


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small random weights (never zeros: they hide wrong indexing and run faster than real data); quantized
    layers draw codes and scales that dequantize to weights of the same spread."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    filled: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.fill_random(gen, std=0.02)
            filled.update(id(p) for p in module.parameters())
    for name, param in model.named_parameters():
        if id(param) in filled:
            continue
        if "norm" in name.lower():  # RMSNorm and LayerNorm (BERT's "LayerNorm"): a scale near 1, a shift near 0
            if name.endswith("bias"):
                param.normal_(0.0, 0.02, generator=gen)
            else:
                param.uniform_(0.9, 1.1, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)
