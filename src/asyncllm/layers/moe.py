"""A sparse mixture-of-experts MLP (Qwen3-MoE's): a router picks each token's top k of E SiLU-gated experts,
whose outputs are summed with the routing weights.

The experts' weights are stacked, [E, out, in] (`ExpertLinear`), loaded one expert's checkpoint tensor at a
time or all experts' at once; the torch form calls the specification (`asyncllm.kernels.moe_ref`), the fused
form the grouped-GEMM Triton kernel (`asyncllm.kernels.fused_moe`). Under tensor parallelism every rank holds
every expert's slice of the intermediate dimension (gate/up rows, down columns) and one all-reduce sums the
partial outputs (`ParallelSparseMoE`). Knows no checkpoint names beyond its own modules'.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from asyncllm.kernels.moe_ref import experts_ref, route_ref
from asyncllm.layers.fusion import Fusable
from asyncllm.layers.linear import Linear, gate_up_shards
from asyncllm.layers.parallel import TPGroup
from asyncllm.layers.param_dtype import empty_parameter


class ExpertLinear(nn.Module):
    """`num_experts` linear maps of one shape, stacked: weight [E, out, in]. Its output rows may pack several
    checkpoint projections (`shards`, e.g. gate then up), as `PackedLinear` does; a checkpoint tensor fills
    one expert's rows ([rows, in]) or every expert's at once ([E, rows, in], GGUF's stacked layout)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, shards: dict[str, int] | None = None):
        super().__init__()
        if shards is not None and sum(shards.values()) != out_features:
            raise ValueError(f"shards {shards} do not add up to out_features={out_features}")
        self.weight = empty_parameter(num_experts, out_features, in_features)
        self.num_experts = num_experts
        self.shard_sizes: dict[str | None, int] = {None: out_features}  # None: one unpacked projection
        if shards is not None:
            self.shard_sizes = {name: size for name, size in shards.items()}
        self._offsets: dict[str | None, int] = {}
        offset = 0
        for name, size in self.shard_sizes.items():
            self._offsets[name] = offset
            offset += size

    def load_shard(self, param_name: str, shard: str | None, loaded: torch.Tensor, expert: int | None) -> None:
        """Copy a checkpoint tensor into the rows of `shard` (None: all rows, when nothing is packed) of
        `expert`, or of every expert when `expert` is None."""
        if param_name != "weight":
            raise ValueError(f"{param_name!r} is not a parameter of this layer (experts have no bias)")
        if shard not in self._offsets:
            raise ValueError(f"shard={shard!r} is not one of {list(self._offsets)}")
        start = self._offsets[shard]
        rows = slice(start, start + self.shard_sizes[shard])
        target = self.weight.data[:, rows] if expert is None else self.weight.data[expert, rows]
        if tuple(loaded.shape) != tuple(target.shape):
            what = "every expert" if expert is None else f"expert {expert}"
            raise ValueError(
                f"shard {shard!r} of {what}: checkpoint shape {tuple(loaded.shape)} does not match the expected "
                f"{tuple(target.shape)}; the config and the weights disagree"
            )
        target.copy_(loaded)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, out={self.weight.shape[1]}, in={self.weight.shape[2]}"


class Experts(nn.Module):
    """Every expert's gated MLP, stacked: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        shards = gate_up_shards(intermediate_size)
        self.gate_up_proj = ExpertLinear(num_experts, hidden_size, 2 * intermediate_size, shards)
        self.down_proj = ExpertLinear(num_experts, intermediate_size, hidden_size)


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SparseMoE(nn.Module, Fusable):
    """y_t = sum over the top k experts e of softmax(router(x_t)) (renormalised over the k when `renormalize`)
    times expert e's gated MLP of x_t."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, bias=False)  # the router: [T, H] -> [T, E] logits
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.top_k = top_k
        self.renormalize = renormalize
        self._experts_fn: ExpertsFn = experts_ref

    @property
    def fused(self) -> bool:
        return self._experts_fn is not experts_ref

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}, fused={self.fused}"

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.fused_moe import fused_moe

        self._experts_fn = fused_moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = route_ref(self.gate(x), self.top_k, self.renormalize)  # [T, K] each
        w13, w2 = self.experts.gate_up_proj.weight, self.experts.down_proj.weight
        return self._experts_fn(x, w13, w2, weights, ids)


class ParallelSparseMoE(SparseMoE):
    """This rank's slice of every expert's intermediate dimension (the router whole on every rank, so every
    rank routes alike); the partial outputs are all-reduced once."""

    def __init__(self, local: SparseMoE, group: TPGroup) -> None:
        nn.Module.__init__(self)  # adopt the local layer's modules instead of allocating new ones
        self.gate = local.gate
        self.experts = local.experts
        self.top_k = local.top_k
        self.renormalize = local.renormalize
        self._experts_fn = local._experts_fn
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))
