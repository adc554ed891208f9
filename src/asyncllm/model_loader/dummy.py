"""Random weights of a model's real shape, for benchmarks (`load_format="dummy"`)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small random weights (never zeros: they hide wrong indexing and run faster than real data)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.9, 1.1, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)
