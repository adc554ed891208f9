"""The attention backend interface: every implementation (torch reference, Triton, flash-attn) fits it.

A backend does two things per layer: `write_kv` stores this step's keys and values into the paged cache,
`attend` attends each query token to its sequence's cached keys causally, or only to the last `window` of
them for a sliding-window layer. They are separate so a fused kernel (rotary + KV write) can replace the
first. Inputs come per step in `AttentionMetadata`; the window comes per layer; nothing is global.

Per step, before the forward pass, `plan` derives on the host what every layer reuses (an `AttentionPlan`)
as plain ints, its work list; the caller uploads that list (the worker stages it in the step's one copy)
and `bind`s the plan to the device tensor. A backend never uploads on its own in a step, and knows no
staging.

KV cache layout, per layer: key and value tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].
Token `t` of a sequence lives in block `block_table[t // block_size]`, row `t % block_size`. A sliding-window
layer never reads a key outside its window: when every layer slides, the block manager may hand the blocks
behind every window to other sequences while the block table still names them.

The cache holds the activations' dtype, or (kv_cache_dtype="fp8") e4m3 codes with one float32 scale per layer
for keys and one for values, `k_scale` and `v_scale` (tensors of one element, on the cache's device): a write
stores k / k_scale and v / v_scale saturated to +-448, a read sees code * scale (kernels/kv_cache_fp8_ref.py).
Both methods take the layer's scales; a cache in the activations' dtype ignores them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.kernels.kv_cache_fp8_ref import write_kv
from asyncllm.layers.host_copy import copy_into, to_device


@dataclass(frozen=True)
class PlanBounds:
    """The static shape a step is planned for, padding included (a CUDA graph is captured and replayed at
    it): launch shapes may depend on these bounds only, so one captured graph serves every step within them."""

    max_tokens: int  # query rows
    max_seqs: int  # sequences
    max_seq_len: int  # keys of any sequence
    decode_only: bool = False  # every sequence has one query token: exactly max_seqs == max_tokens of them


class AttentionPlan(ABC):
    """What a backend derives once per step and every layer reuses (index tensors, splits). Made on the host
    by `AttentionBackend.plan`: `work` holds, as host ints of the backend's `work_dtype` (a list, or a numpy
    array where the plan is made in numpy), every value its device tensors will hold; `bind` then makes those
    tensors views of the uploaded `work`."""

    work: list[int] | np.ndarray

    @property
    def graph_variant(self) -> int:
        """Which of the backend's `graph_variants` this plan launches (a captured graph per variant)."""
        return 0

    @abstractmethod
    def bind(self, work: torch.Tensor) -> None:
        """Take `work` on the device ([len(self.work)] of the backend's `work_dtype`, already written or to be
        written by a copy queued before the forward pass)."""


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
    plan: AttentionPlan | None = None  # the step's plan, bound (`AttentionBackend.plan`); None: none yet
    # The block table's host rows ([>= B, max_blocks] int32, what `block_tables` holds) and the cache's block
    # size, where the caller keeps them (the worker does): a backend may plan from them (cascade decode).
    block_tables_cpu: np.ndarray | None = None
    block_size: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each new token's key/value ([T, Hkv, D]) into its cache slot (quantized, in an FP8 cache)."""
    write_kv(k_cache, slot_mapping, k, k_scale)
    write_kv(v_cache, slot_mapping, v, v_scale)


class AttentionBackend(ABC):
    """Stateless implementation of paged attention; one instance is shared by every layer."""

    name: str
    supports_cuda_graphs: bool = False  # whether `plan` takes static bounds (a captured graph replays it)
    work_dtype: torch.dtype = torch.int32  # the dtype of every plan's `work`

    def plan(
        self, meta: AttentionMetadata, bounds: PlanBounds | None = None, variant: int | None = None
    ) -> AttentionPlan | None:
        """The step's plan, on the host (called once per step, before its inputs are sent; nothing inside the
        layers then needs a host-to-device copy that could stall the host). None: the backend plans nothing.
        `variant`: one of `graph_variants(bounds)` to plan for whatever the step holds (a graph's capture);
        None: the backend picks what suits the step.

        `bounds` given (backends that `supports_cuda_graphs`): the step, padding included, fits them, and
        launch shapes depend on them only. The work list then has the same length for the same bounds, and
        the caller puts it at the same device address every step: a captured graph reads it there, and one
        graph replays any step within its bounds. Rows past the step's tokens are padding: their output is
        never read. Without bounds, the plan fits this step alone."""
        return None

    def graph_variants(self, bounds: PlanBounds) -> tuple[int, ...]:
        """The launch variants a plan within `bounds` may take (`AttentionPlan.graph_variant`): a CUDA graph is
        captured for each, and a step replays its plan's."""
        return (0,)

    def work_size(self, bounds: PlanBounds) -> int:
        """The most `work` entries a plan within `bounds` holds (what a caller reserves for it)."""
        return 0

    def plan_and_upload(
        self, meta: AttentionMetadata, bounds: PlanBounds | None = None, into: torch.Tensor | None = None
    ) -> None:
        """`plan`, its work list uploaded at once and the plan bound into `meta.plan`: for callers outside a
        worker's step (tests, benchmarks, a layer called without a plan). `into`: a device tensor the work
        list is copied into (a static plan's fixed address); else a fresh upload."""
        plan = self.plan(meta, bounds)
        if plan is not None:
            work = plan.work if isinstance(plan.work, list) else plan.work.tolist()
            if into is None:
                plan.bind(to_device(work, self.work_dtype, meta.seq_lens.device))
            else:
                copy_into(into, work)
                plan.bind(into[: len(work)])
        meta.plan = plan

    def write_kv(
        self,
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: torch.Tensor | None = None,  # an FP8 cache's scales (see the module); else unused
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Store this step's keys and values at `meta.slot_mapping`."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's KV written
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: torch.Tensor | None = None,  # an FP8 cache's scales (see the module); else unused
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of each query over its sequence's cached keys (this step's included). With a
        `window`, the query at position p sees keys p - window + 1 .. p only (transformers' sliding window:
        `kv_idx > q_idx - window`), and no key before them is read."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`write_kv` then `attend`: the whole op for callers that hold k and v."""
        self.write_kv(k, v, k_cache, v_cache, meta, k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, meta, scale, window, k_scale, v_scale)
