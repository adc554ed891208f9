"""Fused kernels are opted into per layer: `use_fused_kernels` switches exactly the `Fusable` layers."""

from __future__ import annotations

from torch import nn

from asyncllm.layers.fusion import Fusable, use_fused_kernels


class _LooksFusable(nn.Module):
    """Has the method's name but never opted in: it must be left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = False

    def enable_fused_kernels(self) -> None:
        self.enabled = True


class _OptedIn(nn.Module, Fusable):
    def __init__(self) -> None:
        super().__init__()
        self.enabled = False

    def enable_fused_kernels(self) -> None:
        self.enabled = True


def test_only_fusable_layers_are_switched() -> None:
    bystander, opted = _LooksFusable(), _OptedIn()
    model = nn.Sequential(bystander, opted, nn.Linear(2, 2))
    assert use_fused_kernels(model) == 1
    assert opted.enabled and not bystander.enabled
