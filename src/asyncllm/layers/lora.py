"""A linear layer with LoRA adapters: its base output plus, for each token with an adapter, that adapter's
x @ A^T @ B^T, in one batch mixing adapters and tokens with none (batched kernels: `kernels/lora.py`; the torch
form calls `lora_ref`, their specification).

Every wrapped layer of a model reads one `LoRABatch`: which rows use which adapter slot this step, in tensors
at fixed device addresses the worker rewrites each step (CUDA graphs bake the addresses in), and whether the
step has any adapter row at all (`active`; when not, the layer is exactly its base and launches nothing). The
adapters' weights are views of the worker's slot pool. Knows nothing of adapter files, of which adapter sits
in which slot, nor of requests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.kernels.lora_plan import LoRAPath
from asyncllm.kernels.lora_ref import lora_ref
from asyncllm.layers.fusion import Fusable
from asyncllm.layers.linear import Linear
from asyncllm.layers.parallel import RowParallelLinear


class LoRABatch:
    """One step's adapter rows, shared by every LoRA layer of a model; the worker binds the tensors once and
    rewrites their contents (and `active`) every step.

    - torch form: `token_slots` [>= T] int32, each row's slot or -1;
    - kernels (`kernels` True once a layer enabled them): `block_tokens` and `block_slot`, int32, the block
      tables of `plan_lora_blocks`.
    """

    def __init__(self) -> None:
        self.active = False
        self.kernels = False
        self.token_slots: torch.Tensor | None = None
        self.block_tokens: torch.Tensor | None = None
        self.block_slot: torch.Tensor | None = None


class LoRALinear(nn.Module, Fusable):
    """`base` (a `Linear`, `PackedLinear` or `RowParallelLinear`) plus the adapters in `a` [slots, S * R, in]
    and `b` [slots, out, R] (S: the output's shards, `shard_sizes`; R: the padded rank; scaling in `b`).

    A row-parallel base adds the LoRA into its partial sums before the all-reduce: x_r A_r^T B^T summed over
    the ranks' input columns is x A^T B^T, so adapters cost no collective of their own."""

    def __init__(
        self, base: Linear, a: torch.Tensor, b: torch.Tensor, shard_sizes: tuple[int, ...], batch: LoRABatch
    ) -> None:
        super().__init__()
        assert b.shape[1] == sum(shard_sizes) and a.shape[1] == len(shard_sizes) * b.shape[2], "pool views"
        self.base = base
        self.a = a  # views of the pool: plain attributes, not parameters or buffers (never loaded or moved)
        self.b = b
        self.shard_sizes = shard_sizes
        self.batch = batch
        self._row_parallel = isinstance(base, RowParallelLinear)
        self._kernel: Callable[..., torch.Tensor] | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def enable_fused_kernels(self) -> None:
        from asyncllm.kernels.lora import LoRAAdd

        self._kernel = LoRAAdd(self.a, self.b, self.shard_sizes)  # checks and plans each shape of call once
        self.batch.kernels = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if not self.batch.active:
            return base(x)  # type: ignore[no-any-return]
        row_parallel = self._row_parallel
        y = F.linear(x, base.weight) if row_parallel else base(x)  # [T, out]
        self.add_adapters(x if x.stride(-1) == 1 else x.contiguous(), y)
        return base.reduce(y) if row_parallel else y  # type: ignore[operator]

    def add_adapters(self, x: torch.Tensor, y: torch.Tensor, path: LoRAPath | None = None) -> None:
        """y += each row's adapter's x @ A^T @ B^T, in place, for the rows the batch names; `path` forces one of
        the kernels' paths (kernels/lora_plan.py: warming both up), else the plan picks it from the shapes."""
        batch = self.batch
        if self._kernel is not None:
            assert batch.block_tokens is not None and batch.block_slot is not None, "LoRABatch not bound"
            self._kernel(x, y, batch.block_tokens, batch.block_slot, path)
        else:
            assert batch.token_slots is not None, "LoRABatch not bound"
            lora_ref(x, y, self.a, self.b, batch.token_slots[: x.shape[0]], self.shard_sizes)

    def extra_repr(self) -> str:
        return f"slots={self.a.shape[0]}, rank={self.b.shape[2]}, shards={self.shard_sizes}"
