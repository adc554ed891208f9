"""Switching a built model from its pure-PyTorch layers to the fused Triton kernels, from outside.

Every layer with a fused form implements `enable_fused_kernels()` (importing its kernel then); the model
files stay maths, and the torch form stays the twin the kernels are tested against.
"""

from __future__ import annotations

from torch import nn


def use_fused_kernels(model: nn.Module) -> int:
    """Turn on the fused kernels in every layer of `model` that has them; returns how many layers did."""
    count = 0
    for module in model.modules():
        enable = getattr(module, "enable_fused_kernels", None)
        if callable(enable):
            enable()
            count += 1
    return count
