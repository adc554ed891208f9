"""The attention backend interface: every implementation (torch reference, Triton, flash-attn) fits it.

A backend does two things per layer: `write_kv` stores this step's keys and values into the paged cache,
`attend` attends each query token to its sequence's cached keys causally. They are separate so a fused
kernel (rotary + KV write) can replace the first. Inputs come per step in `AttentionMetadata`; nothing is
global.

KV cache layout, per layer: key and value tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].
Token `t` of a sequence lives in block `block_table[t // block_size]`, row `t % block_size`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from asyncllm.layers.step_staging import StagedRegion


class AttentionPlan:
    """Base of whatever a backend derives once per step and every layer reuses (index tensors, splits)."""


@dataclass
class AttentionMetadata:
    """One step's batch layout. Sequences are packed: sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]`, which are its last query_len tokens of `seq_lens[i]`."""

    query_start_loc: torch.Tensor  # [B + 1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device: cached + new tokens of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, device; unused entries are 0
    slot_mapping: torch.Tensor  # [T] int64, device: cache slot (block * block_size + row) of each new token
    # Host copies, so the reference path and launch heuristics never sync on the device.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    plan: AttentionPlan | None = None  # set by `AttentionBackend.prepare`
    # An int32 region of at least B entries at a fixed device address, sent with the step's inputs (one copy):
    # where a graph plan writes what varies per step. None: the backend keeps and uploads its own.
    work: StagedRegion | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's key/value ([T, Hkv, D]) into its cache slot."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class AttentionBackend(ABC):
    """Stateless implementation of paged attention; one instance is shared by every layer."""

    name: str
    supports_cuda_graphs: bool = False  # whether `plan_graph_decode` and `plan_graph_mixed` are implemented

    def plan_graph_decode(self, meta: AttentionMetadata, num_seqs: int, max_seq_len: int) -> None:
        """Plan a decode-only step of exactly `num_seqs` single-token sequences (padding included) for CUDA
        graph capture and replay: launch shapes may depend on `num_seqs` and `max_seq_len` (a static bound)
        only; what varies per step (e.g. the order sequences are attended in) goes into `meta.work` (sent with
        the step's inputs) or, without it, into tensors the backend keeps at fixed addresses and rewrites, on
        the device's stream, each time a step is planned. Called for every step, before its inputs are sent."""
        raise NotImplementedError(f"the {self.name!r} attention backend cannot run inside CUDA graphs")

    def plan_graph_mixed(self, meta: AttentionMetadata, max_tokens: int, max_seqs: int, max_seq_len: int) -> None:
        """Plan any step (prompt chunks and decodes) of at most `max_tokens` query rows, padding included, in
        at most `max_seqs` sequences, for CUDA graph capture and replay. Launch shapes may depend on the
        three bounds only; the step's own work list goes into tensors the backend keeps at fixed addresses
        (one set per pair of bounds) and rewrites, on the device's stream, every time a step is planned, so
        one captured graph replays any step within its bounds. Rows past the step's tokens are padding:
        their attention output is never read."""
        raise NotImplementedError(f"the {self.name!r} attention backend cannot run inside CUDA graphs")

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by every layer (index tensors, split plans), stored in `meta.plan`.

        Called once per step before the forward pass, so no layer repeats it and nothing inside the layers
        needs a host-to-device copy that could stall the host. The default plans nothing.
        """
        meta.plan = None

    def write_kv(
        self,
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store this step's keys and values at `meta.slot_mapping`."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's KV written
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of each query over its sequence's cached keys (this step's included)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """`write_kv` then `attend`: the whole op for callers that hold k and v."""
        self.write_kv(k, v, k_cache, v_cache, meta)
        return self.attend(q, k_cache, v_cache, meta, scale)
