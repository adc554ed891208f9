"""Tensor-parallel forms of the layers: row-parallel linear (partial sums all-reduced), vocab-parallel
embedding (masked lookup, all-reduced) and vocab-parallel LM head (logits all-gathered to every rank).

Each wraps the parameters of an already built local-size layer, so a model file stays maths and is
sharded from outside (`models.tensor_parallel`). The collectives come from a `TPGroup` passed in; this
file knows no process group, backend or launcher. Column-parallel layers need no class of their own: a
`Linear` built at its local output size computes its rows of the output, with nothing to combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers.embedding import LMHead, VocabEmbedding
from asyncllm.layers.linear import Linear


class TPGroup(Protocol):
    """The collectives of one tensor-parallel group, as the sharded layers use them. Every rank calls the
    same collectives in the same order; each must also work inside a CUDA graph capture (NCCL)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`. Every rank ends with the same bits. Every rank passes
        a tensor of the same shape, dtype, layout and address alignment (the path taken depends on them)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] on each rank -> [world_size * N, ...], rank-major, on every rank."""
        ...


@dataclass(frozen=True)
class WeightShard:
    """The part of a checkpoint tensor one rank holds: indices [start, stop) along `dim`, zero-padded to
    `size` (the vocabulary's last shard when the vocabulary does not divide by the ranks)."""

    dim: int
    start: int
    stop: int
    size: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of a whole tensor (for formats that cannot read a slice from disk)."""
        return self.pad(full.narrow(self.dim, self.start, self.stop - self.start))

    def pad(self, part: torch.Tensor) -> torch.Tensor:
        missing = self.size - part.shape[self.dim]
        if missing == 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)


class RowParallelLinear(Linear):
    """y = all_reduce(x_r W_r^T) + b: this rank holds the input columns of its shard of x (o_proj after
    its heads, down_proj after its slice of the MLP). The bias, replicated, is added once after the sum."""

    def __init__(self, local: Linear, group: TPGroup) -> None:
        nn.Module.__init__(self)  # adopt the local layer's parameters instead of allocating new ones
        self.weight = local.weight
        self.bias = local.bias
        self.group = group
        self._no_gemv()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.project(x, None))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """[T, out] partial sums of this rank's columns -> the layer's output: their total over the ranks, plus
        the bias (a LoRA adds its own partial sums first: they sum the same way)."""
        y = self.group.all_reduce(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(VocabEmbedding):
    """Rows [rank * V_r, (rank + 1) * V_r) of the embedding; ids outside them give zeros, and the all-reduce
    adds the one rank's row to zeros: exactly the unsharded lookup."""

    def __init__(self, local: VocabEmbedding, group: TPGroup) -> None:
        nn.Module.__init__(self)
        self.weight = local.weight
        self.group = group
        self.vocab_start = group.rank * local.weight.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.group.all_reduce(out.masked_fill_(outside[:, None], 0.0))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered so every rank holds the whole [N, vocab] (and
    samples the same tokens from it). `weight` is the rank's own head, or its embedding shard when tied."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # [V_r, hidden]
        self.vocab_size = vocab_size  # the whole vocabulary: padded rows of the last shard are cut off
        self.group = group

    @classmethod
    def from_head(cls, head: LMHead, vocab_size: int, group: TPGroup) -> ParallelLMHead:
        return cls(head.weight, vocab_size, group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)  # [N, V_r]
        n, shard = local.shape
        gathered = self.group.all_gather(local)  # [world * N, V_r], rank-major
        logits = gathered.view(self.group.world_size, n, shard).transpose(0, 1).reshape(n, -1)  # [N, world * V_r]
        return logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size].contiguous()


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's equal share of `size` items (`size` divisible by `world_size`)."""
    assert size % world_size == 0, (size, world_size)
    share = size // world_size
    return rank * share, (rank + 1) * share
