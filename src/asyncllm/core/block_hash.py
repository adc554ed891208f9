"""Chained prefix hashes of full KV blocks.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal whole prefixes.
xxh3-64 over a packed buffer: fast, and collisions are negligible at the cache sizes we run.
"""

from __future__ import annotations

from array import array

import xxhash

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    # Unsigned: xxh3 digests use all 64 bits (a signed array overflowed on about half of all parents).
    # Token ids are validated non-negative, so they pack as unsigned too.
    buf = array("Q", [parent_hash])
    buf.extend(token_ids)
    return xxhash.xxh3_64_intdigest(buf.tobytes())


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int, num_blocks: int) -> None:
    """Append hashes to `hashes` until it covers the first `num_blocks` full blocks of `token_ids`."""
    assert num_blocks * block_size <= len(token_ids), "only full blocks are hashed"
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
