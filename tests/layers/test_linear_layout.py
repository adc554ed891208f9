"""A linear weight stored [in, out] (worker/gemm_layout.py picks it for shapes cuBLAS runs faster that way)
is the same [out, in] matrix to the model: outputs and loaded shards are unchanged."""

from __future__ import annotations

import torch

from asyncllm.layers.linear import PackedLinear


def test_transposed_storage_keeps_the_maths() -> None:
    layer = PackedLinear(24, {"gate": 10, "up": 10}, bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()  # type: ignore[union-attr]
    x = torch.randn(5, 24)
    before = layer(x)
    layer.store_weight_transposed()
    assert layer.weight.shape == (20, 24) and layer.weight.t().is_contiguous()
    torch.testing.assert_close(layer(x), before, rtol=1e-6, atol=1e-6)
    gate = torch.randn(10, 24)
    layer.load_shard("weight", "gate", gate)  # shards still load into the view
    assert torch.equal(layer.weight[layer.shard_rows("gate")], gate)
