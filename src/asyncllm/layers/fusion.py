"""Which layers have a fused Triton form, and switching a built model to them from outside.

A layer opts in by deriving from `Fusable` and implementing `enable_fused_kernels()` (importing its kernel
then); `use_fused_kernels` turns on exactly those, so a new module is never fused by accident because it
happens to share a method name (likewise `LaunchesPdl` / `use_pdl`: kernels launched as programmatic
dependents). The model files stay maths, and each layer's torch form, which calls the `kernels/*_ref.py`
specification, stays the twin the kernels are tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn


class Fusable(ABC):
    """A layer with a fused-kernel form. A subclass that changes the maths (another norm form, say) must
    override `enable_fused_kernels` too, or derive from the plain layer instead: the opt-in is inherited."""

    @abstractmethod
    def enable_fused_kernels(self) -> None:
        """Switch this layer's forward to its fused kernel; its result must match the torch form's."""


def use_fused_kernels(model: nn.Module) -> int:
    """Turn on the fused kernels in every `Fusable` layer of `model`; returns how many layers did."""
    count = 0
    for module in model.modules():
        if isinstance(module, Fusable):
            module.enable_fused_kernels()
            count += 1
    return count


class LaunchesPdl(ABC):
    """A layer whose Triton kernels can be launched as programmatic dependents (kernels/pdl.py: CUDA on Hopper
    or newer, each launch overlapping the previous kernel's tail)."""

    @abstractmethod
    def use_pdl(self, on: bool) -> None:
        """Launch this layer's Triton kernels with PDL, or stop; the results do not change."""


def use_pdl(model: nn.Module, on: bool) -> int:
    """Turn programmatic dependent launches on or off in every `LaunchesPdl` layer; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, LaunchesPdl):
            module.use_pdl(on)
            count += 1
    return count
