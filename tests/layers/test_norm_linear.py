"""RMSNorm against transformers' LlamaRMSNorm; packed linears against separate projections; SiluAndMul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from asyncllm.layers.activation import SiluAndMul
from asyncllm.layers.linear import PackedLinear, qkv_shards
from asyncllm.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rmsnorm_equals_transformers(dtype: torch.dtype) -> None:
    ours, theirs = RMSNorm(48, 1e-6), LlamaRMSNorm(48, eps=1e-6)
    weight = torch.rand(48) + 0.5
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(7, 3, 48) * 3).to(dtype)
    assert torch.equal(ours(x), theirs(x))
    assert ours(x).dtype == dtype


def test_packed_qkv_equals_separate_projections() -> None:
    layer = PackedLinear(32, qkv_shards(num_heads=4, num_kv_heads=2, head_dim=8), bias=True)
    parts = {s: (torch.randn(n, 32), torch.randn(n)) for s, n in layer.shard_sizes.items()}
    for shard, (w, b) in parts.items():
        layer.load_shard("weight", shard, w)
        layer.load_shard("bias", shard, b)
    x = torch.randn(5, 32)
    out = layer(x)
    assert out.shape == (5, 32 + 16 + 16)
    for shard, (w, b) in parts.items():
        torch.testing.assert_close(out[:, layer.shard_rows(shard)], F.linear(x, w, b), rtol=1e-6, atol=1e-6)


def test_packed_load_rejects_bad_shape_shard_and_missing_bias() -> None:
    layer = PackedLinear(8, {"gate": 6, "up": 6}, bias=False)
    with pytest.raises(ValueError, match=r"shape \(5, 8\).*\(6, 8\)"):
        layer.load_shard("weight", "gate", torch.randn(5, 8))
    with pytest.raises(ValueError, match="shard='down'"):
        layer.load_shard("weight", "down", torch.randn(6, 8))
    with pytest.raises(ValueError, match="bias"):
        layer.load_shard("bias", "up", torch.randn(6))


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    assert torch.equal(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])
