"""Cascade decode attention's host side: which decode sequences share the leading blocks of their block tables
(prefix-cache hits share physical blocks), grouped into units whose shared prefix one program per KV head and
split reads once for every member (kernels/paged_attention_cascade.py). Plain numpy over the host block table
and lengths; no Triton, no device (`Cascade` only names the device lists a launch takes). Knows nothing of
requests: only that equal block ids mean equal keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# A shared prefix shorter than this many tokens is left to the plain kernel: its one read saves less than the
# extra partials and the reduce cost.
MIN_PREFIX_TOKENS = 128
# Query rows (members x query heads per KV head) one prefix program attends at once: a tile of tl.dot.
UNIT_ROWS = 64
UNIT_FIELDS = 4  # a unit in the work list: prefix tokens, its block-table row, first member, member count


def unit_members(group: int) -> int:
    """Members one unit holds at most: its rows are members x `group` query heads."""
    return max(1, UNIT_ROWS // group)


def unit_capacity(num_seqs: int, max_members: int) -> int:
    """The most units `num_seqs` decode rows can form (`find_shared_prefixes`' balanced chunks)."""
    return num_seqs // 2 if max_members >= 3 else num_seqs


@dataclass(frozen=True)
class Cascade:
    """A cascade decode launch's lists (`cascade_work`), int32 on q's device, beside the decode work list they
    index (kernels/paged_attention.py `paged_decode_attention`): `skip` [Bd] the shared-prefix keys of each
    work-list entry (0: not in a unit); `units` [UNIT_FIELDS * U]; `members` [Bd] work-list positions.
    `prefix_splits`: the splits of each unit's prefix (each a partial beside the decode kernel's);
    `max_members`: the most members a unit holds (`unit_members`: the prefix kernel's rows are sized for it)."""

    skip: torch.Tensor
    units: torch.Tensor
    members: torch.Tensor
    prefix_splits: int
    max_members: int


@dataclass(frozen=True)
class SharedPrefixes:
    """A step's decode sequences grouped by shared prefix. `skip[i]`: the prefix tokens batch row i reads
    through its unit (0: none, the plain kernel reads all its keys); `rows`: batch rows, each group's together;
    `units` [U, UNIT_FIELDS]: prefix tokens, the batch row whose block table the prefix is read through, and
    the unit's members as `rows[first : first + count]`, at most `max_members` of them."""

    skip: np.ndarray  # [B] int64
    rows: np.ndarray  # [grouped rows] int64
    units: np.ndarray  # [U, UNIT_FIELDS] int64


def find_shared_prefixes(
    tables: np.ndarray,  # [>= B, max_blocks] int32: the host block table (rows past B ignored)
    seq_lens: Sequence[int] | np.ndarray,  # [B]: keys of each decode sequence, this step's included
    block_size: int,
    max_members: int,
    min_prefix_tokens: int = MIN_PREFIX_TOKENS,
) -> SharedPrefixes | None:
    """Groups the rows whose tables begin with the same physical block; a group's prefix is the leading blocks
    every member's table holds alike, never the block of a member's last key (so each member keeps at least one
    key of its own and its suffix is never empty). None when no group of two shares `min_prefix_tokens`.

    A step whose rows share no first block pays one sort of the first column (block 0 is left out: a padding
    row's table is all 0s; two sequences starting in block 0 itself merely miss the cascade). The common-prefix
    comparison runs over the grouped rows only."""
    n = len(seq_lens)
    first = np.sort(tables[:n, 0])
    if not np.any((first[1:] == first[:-1]) & (first[1:] != 0)):
        return None
    cap = (np.asarray(seq_lens, dtype=np.int64) - 1) // block_size  # blocks each row may share
    min_blocks = max(1, -(-min_prefix_tokens // block_size))
    rows = np.flatnonzero((cap >= min_blocks) & (tables[:n, 0] != 0))
    first = tables[rows, 0]
    rows = rows[np.argsort(first, kind="stable")]  # stable: members stay in batch order
    first = tables[rows, 0]
    boundary = np.empty(len(rows), dtype=bool)
    boundary[:1] = True
    np.not_equal(first[1:], first[:-1], out=boundary[1:])
    sizes = np.diff(np.append(np.flatnonzero(boundary), len(rows)))
    if not len(sizes) or sizes.max() < 2:
        return None
    rows = rows[np.repeat(sizes >= 2, sizes)]
    sizes = sizes[sizes >= 2]
    starts = np.cumsum(sizes) - sizes  # the groups' starts among the grouped rows
    leaders = np.repeat(rows[starts], sizes)
    width = int(cap[rows].max())
    same = tables[rows, :width] == tables[leaders, :width]  # [grouped rows, width]
    diverge = same.argmin(axis=1)  # the first column that differs, or 0 when none does
    lcp = np.where(same[np.arange(len(rows)), diverge], width, diverge)
    prefix = np.minimum.reduceat(np.minimum(lcp, cap[rows]), starts)  # blocks each group shares
    prefix[prefix < min_blocks] = 0
    if not prefix.any():
        return None
    skip = np.zeros(n, dtype=np.int64)
    skip[rows] = np.repeat(prefix * block_size, sizes)
    # Each kept group in balanced chunks of at most max_members: with max_members >= 3 each holds two members
    # or more, so units never outnumber half the rows (`unit_capacity`).
    kept = prefix > 0
    starts, sizes, prefix = starts[kept], sizes[kept], prefix[kept]
    chunks = -(-sizes // max_members)
    group = np.repeat(np.arange(len(sizes)), chunks)  # each unit's group
    c = np.arange(len(group)) - np.repeat(np.cumsum(chunks) - chunks, chunks)  # its chunk in the group
    lo = starts[group] + sizes[group] * c // chunks[group]
    hi = starts[group] + sizes[group] * (c + 1) // chunks[group]
    units = np.stack([prefix[group] * block_size, rows[starts[group]], lo, hi - lo], axis=1)
    return SharedPrefixes(skip, rows, units)


def cascade_work(
    shared: SharedPrefixes | None, seq_lens: Sequence[int] | np.ndarray, unit_capacity: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The decode kernels' lists for a cascade launch over B = len(seq_lens) decode rows: (order, skip, units,
    members). `order`: batch rows, most keys left to walk (after the prefix) first; `skip`: per position of
    `order`; `units` [unit_capacity, UNIT_FIELDS]: the units, then empty ones (count 0); `members` [B]:
    positions in `order`, each unit's `first` .. `first + count`, then 0s."""
    n = len(seq_lens)
    lens = np.asarray(seq_lens, dtype=np.int64)
    skip = np.zeros(n, dtype=np.int64) if shared is None else shared.skip
    order = np.argsort(skip - lens, kind="stable")
    units = np.zeros((unit_capacity, UNIT_FIELDS), dtype=np.int64)
    members = np.zeros(n, dtype=np.int64)
    if shared is not None:
        if len(shared.units) > unit_capacity:
            raise ValueError(f"{len(shared.units)} cascade units do not fit a plan for {unit_capacity}")
        units[: len(shared.units)] = shared.units
        position = np.empty(n, dtype=np.int64)
        position[order] = np.arange(n)
        members[: len(shared.rows)] = position[shared.rows]
    return order, skip[order], units, members
