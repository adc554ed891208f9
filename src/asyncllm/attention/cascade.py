"""Cascade decode attention's planning for the Triton backend: a decode step's work list with its shared-prefix
units (kernels/cascade_plan.py finds them in the host block table), laid out at fixed offsets per decode bucket
so one captured graph replays any grouping. Knows the kernels' list formats, not their insides; plain host data.

Work list of a cascade plan (int32, each part 16-byte aligned): the decode order (most keys after the prefix
first), each entry's skipped prefix keys, the units (room for every unit the bucket's rows could form; empty
ones have no members) and their members (work-list positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.kernels.cascade_plan import (
    MIN_PREFIX_TOKENS,
    UNIT_FIELDS,
    Cascade,
    cascade_work,
    find_shared_prefixes,
    unit_capacity,
    unit_members,
)
from asyncllm.kernels.paged_attention_plan import MAX_SPLITS, choose_num_splits

# The members a unit is expected to hold when its prefix splits are chosen (they must fill the GPU beside the
# other units without knowing how many there will be): W3's groups are 16 requests.
_EXPECTED_MEMBERS = 16


@dataclass(frozen=True)
class CascadeDecode:
    """Cascade decode attention's settings (ASYNCLLM_CASCADE_ATTENTION on): the model's query heads per KV head (a
    unit's rows are members x these) and the shortest shared prefix worth a unit."""

    group: int
    min_prefix_tokens: int = MIN_PREFIX_TOKENS
    prefix_splits: int | None = None  # each unit's prefix splits; None: chosen per decode bucket (`cascade_layout`)

    @property
    def max_members(self) -> int:
        return int(unit_members(self.group))


@dataclass(frozen=True)
class CascadeLayout:
    """Where a cascade plan's lists sit in its work list, and its launch's split counts, for one decode bucket."""

    num_seqs: int
    num_splits: int  # the decode kernel's splits of each sequence's keys after its prefix
    prefix_splits: int  # each unit's prefix splits
    units: int  # unit capacity
    max_members: int  # members per unit at most

    @property
    def skip_offset(self) -> int:
        return _aligned4(self.num_seqs)

    @property
    def units_offset(self) -> int:
        return self.skip_offset + _aligned4(self.num_seqs)

    @property
    def members_offset(self) -> int:
        return self.units_offset + int(UNIT_FIELDS) * self.units

    @property
    def size(self) -> int:
        return self.members_offset + self.num_seqs

    def bind(self, work: torch.Tensor) -> Cascade:
        """The kernels' launch argument: views of the uploaded work list."""
        n = self.num_seqs
        return Cascade(
            work[self.skip_offset : self.skip_offset + n],
            work[self.units_offset : self.members_offset],
            work[self.members_offset : self.members_offset + n],
            self.prefix_splits,
            self.max_members,
        )


def cascade_layout(
    settings: CascadeDecode, num_seqs: int, max_seq_len: int, num_kv_heads: int, num_sms: int
) -> CascadeLayout:
    """The layout of a decode bucket of `num_seqs` rows: splits as the plain plan's, the prefix's chosen for
    the units such a batch would form (of `_EXPECTED_MEMBERS`); together within the reduction's width."""
    num_splits = choose_num_splits(max_seq_len, num_seqs, num_kv_heads, num_sms)
    units = max(1, num_seqs // _EXPECTED_MEMBERS)
    prefix_splits = settings.prefix_splits or choose_num_splits(max_seq_len, units, num_kv_heads, num_sms)
    prefix_splits = min(prefix_splits, MAX_SPLITS // 2)
    num_splits = min(num_splits, MAX_SPLITS - prefix_splits)
    members = settings.max_members
    return CascadeLayout(num_seqs, num_splits, prefix_splits, unit_capacity(num_seqs, members), members)


def plan_cascade(
    settings: CascadeDecode, layout: CascadeLayout, meta: AttentionMetadata, forced: bool = False
) -> np.ndarray | None:
    """A decode step's cascade work list; None when no two of its sequences share a prefix long enough
    (the plain plan then runs) unless `forced` (a capture: the cascade launches over no unit)."""
    tables = meta.block_tables_cpu
    if len(meta.seq_lens_cpu) != layout.num_seqs:
        raise ValueError(f"a decode step of {len(meta.seq_lens_cpu)} rows planned for {layout.num_seqs}")
    shared = None
    if tables is not None and meta.block_size:
        shared = find_shared_prefixes(
            tables, meta.seq_lens_cpu, meta.block_size, settings.max_members, settings.min_prefix_tokens
        )
    if shared is None and not forced:
        return None
    order, skip, units, members = cascade_work(shared, meta.seq_lens_cpu, layout.units)
    n = layout.num_seqs
    work = np.zeros(layout.size, dtype=np.int32)  # the backend's work_dtype
    work[:n] = order
    work[layout.skip_offset : layout.skip_offset + n] = skip
    work[layout.units_offset : layout.members_offset] = units.reshape(-1)
    work[layout.members_offset :] = members
    return work


def _aligned4(n: int) -> int:
    return -(-n // 4) * 4
