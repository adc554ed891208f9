"""Loading a checkpoint tensor into its parameter: a tensor the loader made and owns alone (a dequantized GGUF
weight) becomes the parameter itself, where a copy would hold the table twice at the load's peak (a CPU
engine's largest tensor, the embedding); anything else (a view of a mapped file, a slice of a larger tensor,
another dtype) is copied, so no parameter keeps a file mapping or a bigger buffer alive."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from asyncllm.errors import UnsupportedModelError
from asyncllm.models.weights import load_packed_weights


def _load(model: nn.Module, tensor: torch.Tensor) -> None:
    load_packed_weights(model, [("weight", tensor)], {}, lambda name: False)


def test_a_tensor_the_loader_owns_becomes_the_parameter() -> None:
    model = nn.Linear(6, 4, bias=False)
    fresh = torch.randn(4, 6)
    _load(model, fresh)
    assert model.weight.data_ptr() == fresh.data_ptr() and isinstance(model.weight, nn.Parameter)
    assert torch.equal(model(torch.eye(6)), fresh.t())


@pytest.mark.parametrize("kind", ["mapped file", "slice", "other dtype", "transposed"])
def test_anything_else_is_copied(kind: str) -> None:
    model = nn.Linear(6, 4, bias=False)
    values = torch.randn(4, 6)
    if kind == "mapped file":
        buffer = mmap.mmap(-1, values.numel() * 4)
        tensor = torch.frombuffer(buffer, dtype=torch.float32).view(4, 6)
        tensor.copy_(values)
    elif kind == "slice":
        tensor = torch.cat((values, torch.randn(2, 6)))[:4]
    elif kind == "other dtype":
        tensor = values.double()
    else:
        tensor = values.t().contiguous().t()
    _load(model, tensor)
    assert model.weight.data_ptr() != tensor.data_ptr()
    assert torch.equal(model.weight.data, values.to(model.weight.dtype))
    tensor.zero_()  # the parameter is its own memory: the source may change or go
    assert torch.equal(model.weight.data, values)


def test_a_wrong_shape_is_refused_either_way() -> None:
    with pytest.raises(UnsupportedModelError, match="has shape"):
        _load(nn.Linear(6, 4, bias=False), torch.randn(4, 5))
