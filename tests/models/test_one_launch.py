"""models/one_launch.py's `use_one_launch_layers` through its seam (`OneLaunchLayer`): which layers it switches,
and, prefetching "ahead", which layer's qkv weight each launch asks L2 for during its MLP (the next layer's,
where that one runs the same launch: switched and of the same layout). CPU: it plans, it launches nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncllm.models.one_launch import OneLaunchDecoder, OneLaunchLayer, OneLaunchSpec, use_one_launch_layers
from tests.kernels.decode_layer_cases import make_case


class Layer(nn.Module, OneLaunchLayer):
    def __init__(self, hidden: int | None, seed: int = 0) -> None:
        super().__init__()
        self.spec = None
        if hidden is not None:  # None: a layer whose maths is not the kernel's
            self.spec = OneLaunchSpec(make_case([5], hidden, 2, 1, 16, 64, seed=seed).w, 0.25)
        self.decoder: OneLaunchDecoder | None = None

    def one_launch_spec(self) -> OneLaunchSpec | None:
        return self.spec

    def use_one_launch(self, decoder: OneLaunchDecoder | None) -> None:
        self.decoder = decoder


def _next_qkv(layers: list[Layer]) -> list[object]:
    """Per layer: None (not switched), "-" (switched, asks for no other layer) or the index it asks for."""
    out: list[object] = []
    for layer in layers:
        if layer.decoder is None:
            out.append(None)
            continue
        nxt = layer.decoder.next_qkv
        asked = [i for i, other in enumerate(layers) if other.spec and other.spec.weights.qkv is nxt]
        out.append("-" if nxt is None else asked[0])
    return out


def test_ahead_asks_for_the_next_layer_that_runs_the_same_launch() -> None:
    # 0 -> 1 (same layout); 2 is not the kernel's; 3 and 4 differ in layout; 5 -> 6; 6 is last
    layers = [Layer(32, 0), Layer(32, 1), Layer(None), Layer(32, 3), Layer(48, 4), Layer(48, 5), Layer(48, 6)]
    model = nn.ModuleList(layers)
    assert use_one_launch_layers(model, torch.device("cpu"), 1, "ahead") == 6
    assert _next_qkv(layers) == [1, "-", None, "-", 5, 6, "-"]


@pytest.mark.parametrize("prefetch", ["auto", "off", "lines", "bulk"])
def test_only_ahead_asks_for_another_layer(prefetch: str) -> None:
    layers = [Layer(32, 0), Layer(32, 1)]
    assert use_one_launch_layers(nn.ModuleList(layers), torch.device("cpu"), 4, prefetch) == 2
    assert _next_qkv(layers) == ["-", "-"]
