"""Cascade decode attention's host side: which decode sequences share the leading blocks of their block tables
(prefix-cache hits share physical blocks), grouped into units whose shared prefix one program per KV head and
split reads once for every member (kernels/paged_attention_cascade.py). Plain numpy over the host block table
and lengths; no Triton, no device. Knows nothing of requests: only that equal block ids mean equal keys.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

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
class SharedPrefixes:
    """A step's decode sequences grouped by shared prefix. `skip[i]`: the prefix tokens batch row i reads
    through its unit (0: none, the plain kernel reads all its keys); `units`: (prefix tokens, the batch row whose
    block table the prefix is read through, member batch rows), at most `unit_members` members each."""

    skip: np.ndarray  # [B] int64
    units: list[tuple[int, int, list[int]]]


def find_shared_prefixes(
    tables: np.ndarray,  # [>= B, max_blocks] int32: the host block table (rows past B ignored)
    seq_lens: np.ndarray,  # [B] int: keys of each decode sequence, this step's included
    block_size: int,
    max_members: int,
    min_prefix_tokens: int = MIN_PREFIX_TOKENS,
) -> SharedPrefixes | None:
    """Groups the rows whose tables begin with the same physical block; a group's prefix is the leading blocks
    every member's table holds alike, never the block of a member's last key (so each member keeps at least one
    key of its own and its suffix is never empty). None when no group of two shares `min_prefix_tokens`.

    O(B log B) for a batch with no sharing (one sort of the first column); the common-prefix comparison runs
    over the grouped rows only."""
    n = len(seq_lens)
    cap = (np.asarray(seq_lens, dtype=np.int64) - 1) // block_size  # blocks each row may share
    min_blocks = max(1, -(-min_prefix_tokens // block_size))
    rows = np.flatnonzero(cap >= min_blocks)
    if len(rows) < 2:
        return None
    first = tables[rows, 0]
    order = np.argsort(first, kind="stable")  # stable: members stay in batch order
    rows, first = rows[order], first[order]
    boundary = np.empty(len(rows), dtype=bool)
    boundary[0] = True
    np.not_equal(first[1:], first[:-1], out=boundary[1:])
    starts = np.flatnonzero(boundary)
    sizes = np.diff(np.append(starts, len(rows)))
    if sizes.max() < 2:
        return None
    grouped = np.repeat(sizes >= 2, sizes)
    rows = rows[grouped]
    starts, sizes = starts[sizes >= 2], sizes[sizes >= 2]
    starts = np.cumsum(sizes) - sizes  # the groups' starts among the grouped rows
    leaders = np.repeat(rows[starts], sizes)
    width = int(cap[rows].max())
    same = tables[rows, :width] == tables[leaders, :width]  # [grouped rows, width]
    lcp = np.where(same.all(axis=1), width, same.argmin(axis=1))
    prefix = np.minimum.reduceat(np.minimum(lcp, cap[rows]), starts)  # blocks each group shares
    skip = np.zeros(n, dtype=np.int64)
    units: list[tuple[int, int, list[int]]] = []
    for start, size, blocks in zip(starts.tolist(), sizes.tolist(), prefix.tolist()):
        if blocks < min_blocks:
            continue
        members = rows[start : start + size].tolist()
        tokens = blocks * block_size
        skip[members] = tokens
        # Balanced chunks: with max_members >= 3 each holds two members or more, so units never outnumber
        # half the rows (`unit_capacity`).
        chunks = -(-size // max_members)
        bounds = [size * c // chunks for c in range(chunks + 1)]
        units += [(tokens, members[0], members[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
    return SharedPrefixes(skip, units) if units else None


def cascade_work(
    shared: SharedPrefixes | None, seq_lens: np.ndarray, unit_capacity: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The decode kernels' lists for a cascade launch over B = len(seq_lens) decode rows: (order, skip, units,
    members). `order`: batch rows, most keys left to walk (after the prefix) first; `skip`: per position of
    `order`; `units`: UNIT_FIELDS ints per unit, padded with empty units (count 0) to `unit_capacity`;
    `members`: positions in `order`, each unit's `first` .. `first + count`, padded with 0 to B."""
    n = len(seq_lens)
    skip = np.zeros(n, dtype=np.int64) if shared is None else shared.skip
    order = np.argsort(skip - np.asarray(seq_lens, dtype=np.int64), kind="stable")
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    units: list[int] = []
    members: list[int] = []
    for tokens, table_row, rows in shared.units if shared is not None else ():
        units += (tokens, table_row, len(members), len(rows))
        members += position[rows].tolist()
    if len(units) > UNIT_FIELDS * unit_capacity:
        raise ValueError(f"{len(units) // UNIT_FIELDS} cascade units do not fit a plan for {unit_capacity}")
    units += [0] * (UNIT_FIELDS * unit_capacity - len(units))
    members += [0] * (n - len(members))
    return order.tolist(), skip[order].tolist(), units, members
