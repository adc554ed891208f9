"""The specification of batched LoRA, in pure PyTorch: each token of a batch adds its own adapter's
x @ A^T @ B^T to a linear layer's output (Punica/S-LoRA's "shrink" then "expand"), any mix of adapters, and of
tokens with none, in one batch. The layers' torch path calls it; the Triton kernels (lora.py) are tested
against it. Imports only torch.

Adapters sit in slots of stacked weights, zero-padded to one rank R, their scaling folded into B:
- `a` [slots, num_shards * R, K]: a packed layer (q/k/v, gate/up) stacks its shards' A matrices;
- `b` [slots, N, R]: output row n of shard i reads rank columns i * R ... (i + 1) * R of the shrunk rows;
- `token_slots` [T] int: the slot of each token's adapter, -1 for none (its output is left as it is).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _slots_present(token_slots: torch.Tensor) -> list[int]:
    return [s for s in torch.unique(token_slots).tolist() if s >= 0]


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[T, K] -> [T, num_shards * R] float32: x @ a[slot]^T per token (zero rows for tokens without one)."""
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in _slots_present(token_slots):
        rows = (token_slots == slot).nonzero()[:, 0]
        h[rows] = x[rows].float() @ a[slot].float().t()
    return h


def lora_expand_ref(
    h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, token_slots: torch.Tensor, shard_sizes: Sequence[int]
) -> torch.Tensor:
    """y[t, shard i] += h[t, rank block i] @ b[slot, shard i]^T, in place; returns `y`. The shrunk rows are
    rounded to the weights' dtype first (as PEFT's 16-bit layers round lora_A's output), the sum to y's."""
    rank = b.shape[2]
    for slot in _slots_present(token_slots):
        rows = (token_slots == slot).nonzero()[:, 0]
        hs = h[rows].to(b.dtype).float()  # [t, num_shards * R]
        col = 0
        for i, n in enumerate(shard_sizes):
            delta = hs[:, i * rank : (i + 1) * rank] @ b[slot, col : col + n].float().t()  # [t, n]
            y[rows, col : col + n] = (y[rows, col : col + n].float() + delta).to(y.dtype)
            col += n
    return y


def lora_ref(
    x: torch.Tensor,  # [T, K]: the layer's input
    y: torch.Tensor,  # [T, N]: the layer's output, updated in place
    a: torch.Tensor,  # [slots, num_shards * R, K]
    b: torch.Tensor,  # [slots, N, R]
    token_slots: torch.Tensor,  # [T] int, -1: no adapter
    shard_sizes: Sequence[int],  # the output's shards, summing to N (one for an unpacked layer)
) -> torch.Tensor:
    """y += x @ A[slot]^T @ B[slot]^T for every token with an adapter; returns `y`."""
    return lora_expand_ref(lora_shrink_ref(x, a, token_slots), b, y, token_slots, shard_sizes)
