"""Random decode-layer inputs for the persistent decode layer's tests (CPU here, GPU in tests/gpu): weights at a
real model's scale, caches holding every row's earlier keys and values, and each row's new slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.kernels.decode_layer_ref import DecodeLayerWeights


@dataclass
class LayerCase:
    x: torch.Tensor
    residual: torch.Tensor | None
    w: DecodeLayerWeights
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]

    def args(self) -> tuple:
        """decode_layer's positional arguments before `scale` (the caches cloned by the caller if needed)."""
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int32, device=self.x.device)
        return (self.x, self.residual, self.w, self.k_cache, self.v_cache, self.positions, self.cos, self.sin,
                self.slot_mapping, self.block_tables, seq_lens)  # fmt: skip

    def with_caches(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> LayerCase:
        return LayerCase(self.x, self.residual, self.w, k_cache, v_cache, self.positions, self.cos, self.sin,
                         self.slot_mapping, self.block_tables, self.seq_lens)  # fmt: skip


def make_case(
    seq_lens: list[int], hidden: int, heads: int, kv_heads: int, dim: int, inter: int, *, qk_norm: bool = True,
    residual: bool = True, block_size: int = 16, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    seed: int = 0,
) -> LayerCase:  # fmt: skip
    """Rows of the given lengths (new token included; 0: a padding row, slot -1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def norm_weight(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    rows = len(seq_lens)
    w = DecodeLayerWeights(
        input_norm=norm_weight(hidden), qkv=rand((heads + 2 * kv_heads) * dim, hidden, scale=hidden**-0.5),
        q_norm=norm_weight(dim) if qk_norm else None, k_norm=norm_weight(dim) if qk_norm else None,
        o=rand(hidden, heads * dim, scale=(heads * dim) ** -0.5), post_norm=norm_weight(hidden),
        gate_up=rand(2 * inter, hidden, scale=hidden**-0.5), down=rand(hidden, inter, scale=inter**-0.5),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, eps=1e-6,
    )  # fmt: skip
    blocks_per_row = max(1, -(-max(seq_lens) // block_size))
    num_blocks = rows * blocks_per_row + 3
    tables = torch.randperm(num_blocks, generator=gen)[: rows * blocks_per_row].view(rows, blocks_per_row)
    k_cache = rand(num_blocks, block_size, kv_heads, dim)
    v_cache = rand(num_blocks, block_size, kv_heads, dim)
    positions = torch.tensor([max(n - 1, 0) for n in seq_lens])
    slots = [int(tables[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n > 0 else -1
             for r, n in enumerate(seq_lens)]  # fmt: skip
    max_pos = max(seq_lens) + 8
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    x = rand(rows, hidden)
    res = rand(rows, hidden) if residual else None
    on = torch.device(device)
    return LayerCase(
        x.to(on), None if res is None else res.to(on), DecodeLayerWeights(**{
            k: (v.to(on) if isinstance(v, torch.Tensor) else v) for k, v in vars(w).items()}),
        k_cache.to(on), v_cache.to(on), positions.to(on), angles.cos().to(on), angles.sin().to(on),
        torch.tensor(slots, dtype=torch.int64, device=on), tables.to(torch.int32).to(on), list(seq_lens),
    )  # fmt: skip
