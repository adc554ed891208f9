"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up) into one matmul.

A packed layer (`Packed`: plain or quantized) knows the row range of each named shard and copies checkpoint
tensors into it, recording which shards arrived so a model can report any it never received. Parameters are
uninitialised: every one is loaded. Knows nothing about checkpoint names; models map Hugging Face names to
(layer, shard).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.param_dtype import empty_parameter


class Linear(nn.Module):
    """y = x W^T (+ b), W [out, in]; like nn.Linear without the random initialisation."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features)
        self.bias = empty_parameter(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def store_weight_transposed(self) -> None:
        """Keep the weight's memory [in, out] while it stays an [out, in] view: the same maths, but cuBLAS
        then runs the transposed-layout GEMM (faster for some shapes; worker/gemm_layout.py decides)."""
        with torch.no_grad():
            self.weight.data = self.weight.data.t().contiguous().t()


class Packed:
    """The shard bookkeeping of a layer whose output rows stack several projections of the same input, in
    `shards` order. Every parameter of such a layer is [out, ...] (the quantized forms' codes, scales and zero
    points too), so a shard's rows are the same slice of each; the weight loader asks any `Packed` layer."""

    shard_sizes: dict[str, int]
    _offsets: dict[str, int]
    bias: nn.Parameter | None

    def _pack(self, shards: dict[str, int]) -> None:
        self.shard_sizes = dict(shards)
        self._offsets = {}
        offset = 0
        for name, size in shards.items():
            self._offsets[name] = offset
            offset += size

    def shard_rows(self, shard: str) -> slice:
        if shard not in self._offsets:
            raise ValueError(f"shard={shard!r} is not one of {list(self._offsets)}")
        start = self._offsets[shard]
        return slice(start, start + self.shard_sizes[shard])

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> None:
        """Copy a checkpoint tensor into `param_name` ("weight", "bias", ...) rows of `shard`."""
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{param_name!r} is not a parameter of this layer (bias={self.bias is not None})")
        target = param.data[self.shard_rows(shard)]
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(
                f"shard {shard!r} of {param_name}: checkpoint shape {tuple(loaded.shape)} does not match the "
                f"expected {tuple(target.shape)}; the config and the weights disagree"
            )
        target.copy_(loaded)


class PackedLinear(Linear, Packed):
    """Several projections of the same input stacked along the output dim, in `shards` order."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self._pack(shards)


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    return {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}


def gate_up_shards(intermediate_size: int) -> dict[str, int]:
    return {"gate": intermediate_size, "up": intermediate_size}
